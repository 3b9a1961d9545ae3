"""Bounded YAML reading for every file the offline tools accept (jobs, clusters, failure models).

``yaml.safe_load`` alone is not enough for hostile input: an alias bomb ("billion laughs")
builds a tiny shared structure whose expansion any later walk (an error message, a JSON dump)
never finishes; deep nesting overflows the composer's recursion; a non-UTF-8 file or a
4000-digit integer raises a plain ``ValueError``. :func:`parse_yaml_documents` and
:func:`read_yaml_documents` bound all of that up front and raise :class:`YamlInputError`
with a one-line message naming the place (``file:line:column``) and the fix.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

MAX_YAML_BYTES = 2**20  # a job or cluster file is a few KiB
MAX_YAML_DEPTH = 64  # nesting levels of mappings/sequences
MAX_YAML_NODES = 200_000  # nodes after alias expansion (each use of an alias counts in full)


class YamlInputError(ValueError):
    """A YAML file cannot be read or is outside the bounds: ``where`` and a one-line ``message``."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
        self.message = message


class _BoundedLoader(yaml.SafeLoader):
    """``SafeLoader`` that counts nodes (aliases expanded), limits depth, refuses self-aliases."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._open_anchors: list[str | None] = []
        self._sizes: dict[int, int] = {}

    def _fail(self, problem: str) -> None:
        mark = self.peek_event().start_mark
        raise yaml.composer.ComposerError(None, None, problem, mark)

    def _expanded_size(self, node: yaml.Node) -> int:
        """Nodes ``node`` stands for once every alias inside it is expanded (memoised)."""
        size = self._sizes.get(id(node))
        if size is None:
            size = 1
            if isinstance(node, yaml.SequenceNode):
                size += sum(self._expanded_size(child) for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                size += sum(self._expanded_size(k) + self._expanded_size(v)
                            for k, v in node.value)
            self._sizes[id(node)] = size
        return size

    def _count(self, n: int) -> None:
        self._nodes += n
        if self._nodes > MAX_YAML_NODES:
            self._fail(f"expands to more than {MAX_YAML_NODES} nodes (an alias bomb?); "
                       "write the document out without nested aliases")

    def fetch_flow_collection_start(self, token_class: Any) -> None:  # a PyYAML hook
        # the scanner's cost per token grows with the flow level: stop before it is quadratic
        if self.flow_level >= MAX_YAML_DEPTH:
            raise yaml.scanner.ScannerError(
                None, None, f"nests deeper than {MAX_YAML_DEPTH} levels; flatten the document",
                self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent: Any, index: Any) -> Any:  # a PyYAML hook
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                self._fail(f"alias *{event.anchor} refers to a node that contains it "
                           "(a recursive structure); remove the alias")
            node = super().compose_node(parent, index)
            self._count(self._expanded_size(node))
            return node
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            self._fail(f"nests deeper than {MAX_YAML_DEPTH} levels; flatten the document")
        self._open_anchors.append(getattr(event, "anchor", None))
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open_anchors.pop()
        self._count(1)
        return node


# YAML 1.2 (what kubectl and the API server read) takes ``3e-4`` and ``1e300`` as numbers; PyYAML's
# YAML 1.1 resolver wants a dot in a float, so ``learningRate: 3e-4`` would reach the spec as the
# string "3e-4". Resolve exponent floats without a dot as YAML 1.2 does (this loader only).
_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"))


def _mark_of(exc: yaml.YAMLError) -> Any:
    return getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)


def parse_yaml_documents(data: bytes | str, where: str) -> list[Any]:
    """Every YAML document in ``data`` (empty ones dropped), within the bounds above.

    Raises :class:`YamlInputError` naming ``where`` (plus line and column when known).
    """
    if len(data) > MAX_YAML_BYTES:
        raise YamlInputError(where, f"is larger than {MAX_YAML_BYTES // 2**10} KiB; "
                                    "give a job or cluster description, not a data file")
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise YamlInputError(
                where, f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                       f"{exc.start}); save the file as UTF-8") from None
    else:
        text = data
    loader = _BoundedLoader(text)
    try:
        docs = []
        while loader.check_data():
            docs.append(loader.get_data())
    except yaml.MarkedYAMLError as exc:
        mark = _mark_of(exc)
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark else where
        problem = " ".join(str(exc.problem or exc).split())
        raise YamlInputError(at, f"invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise YamlInputError(where, f"invalid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise YamlInputError(where, "invalid YAML: nested too deeply; flatten the "
                                    "document") from None
    except (ValueError, OverflowError) as exc:  # e.g. a 5000-digit integer, a bad timestamp
        msg = " ".join(str(exc).split())[:200]
        raise YamlInputError(where, f"invalid YAML value: {msg}") from None
    finally:
        loader.dispose()
    return [d for d in docs if d is not None]


def read_yaml_documents(path: str | Path) -> list[Any]:
    """:func:`parse_yaml_documents` of a file (``-`` is stdin), read with a size bound."""
    where = str(path)
    try:
        if where == "-":
            data = sys.stdin.buffer.read(MAX_YAML_BYTES + 1)
        else:
            with open(path, "rb") as fh:
                data = fh.read(MAX_YAML_BYTES + 1)
    except FileNotFoundError:
        raise YamlInputError(where, "no such file; check the path") from None
    except IsADirectoryError:
        raise YamlInputError(where, "is a directory; give a YAML file") from None
    except OSError as exc:
        raise YamlInputError(where, f"cannot read: {exc.strerror or exc}") from None
    return parse_yaml_documents(data, where)


def read_yaml_document(path: str | Path) -> Any:
    """The single document of a YAML file (None when it is empty); more than one is an error."""
    docs = read_yaml_documents(path)
    if len(docs) > 1:
        raise YamlInputError(str(path), f"holds {len(docs)} YAML documents; give exactly one")
    return docs[0] if docs else None
