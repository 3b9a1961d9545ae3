"""The ``hettrain`` command line: plan, validate, simulate and demo, all offline.

``plan`` and ``validate`` live here. Other subcommands are hooks into modules owned elsewhere
(:data:`EXTERNAL_COMMANDS`): a module is imported only when its subcommand is chosen, so this file
never imports kopf or kubernetes, and a missing module gives a clear message, not a traceback.

Exit codes: 0 success, 2 bad input or no plan (one line on stderr naming the field or resource and
the fix), 1 reserved for the hooked subcommands' own failures.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from hettrain.api.spec import JobSpec, SpecError, parse_job_manifest, require_data
from hettrain.api.yamlsafe import YamlInputError, read_yaml_documents
from hettrain.argtypes import float_in

EXIT_OK = 0
EXIT_USAGE = 2


@dataclass(frozen=True, slots=True)
class ExternalCommand:
    """A subcommand implemented by ``module.add_arguments(parser)`` and ``module.run(args)``."""

    module: str
    help: str
    extra: str  # pip extra that provides the module's dependencies


# Subcommand → implementing module. Adding one is one line.
EXTERNAL_COMMANDS: dict[str, ExternalCommand] = {
    "simulate": ExternalCommand("hettrain.sim.cli", "simulate training under failures offline",
                                "viz"),
    "demo": ExternalCommand("hettrain.demo", "run the end-to-end demo on a local control plane",
                            "operator"),
    "data": ExternalCommand("hettrain.data.cli", "tokenize text into token sets for spec.data",
                            "runtime"),
    "profile": ExternalCommand("hettrain.profile_cli", "measure the runtime's layer on this "
                               "device and write a device profile for plan --profile", "runtime"),
}


class CliError(Exception):
    """Bad input: the message names the file/field and the fix; exits 2 without a traceback."""


# ---------------------------------------------------------------- input loading


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def load_yaml_documents(path: str) -> list[Any]:
    """All YAML documents of ``path`` (``-`` is stdin), empty documents dropped.

    Read through :mod:`hettrain.api.yamlsafe`: size, nesting and alias expansion are bounded,
    non-UTF-8 and malformed files give one line naming the place.
    """
    try:
        return read_yaml_documents(path)
    except YamlInputError as exc:
        raise CliError(_one_line(str(exc))) from None


def _parse_job_doc(doc: Any) -> tuple[str, JobSpec]:
    if not isinstance(doc, dict):
        raise SpecError("(document)", f"must be a mapping with kind: HetTrainingJob "
                                      f"(got {type(doc).__name__})")
    from hettrain.data.tokenset import check_job_data

    name, spec = parse_job_manifest(doc)
    require_data(spec)  # synthetic tokens only when spec.data.synthetic says so
    check_job_data(spec)  # a local token set must fit the model's vocab
    return name, spec


def load_job(path: str) -> tuple[str, JobSpec]:
    """The single HetTrainingJob in ``path``; raises :class:`CliError` naming the field."""
    docs = load_yaml_documents(path)
    if len(docs) != 1:
        raise CliError(f"{path}: holds {len(docs)} YAML documents; plan takes exactly one "
                       "HetTrainingJob (use 'hettrain validate' for multi-document files)")
    try:
        return _parse_job_doc(docs[0])
    except SpecError as exc:
        raise CliError(f"{path}: {_one_line(str(exc))}") from None


def load_inventory(path: str) -> Any:
    """The cluster description in ``path`` as a ``ClusterInventory``."""
    from hettrain.planning.errors import PlanningError
    from hettrain.planning.inventory import load_cluster

    if path != "-":  # (stdin, a pipe or a FIFO are read like a file)
        try:
            os.stat(path)
        except FileNotFoundError:
            raise CliError(f"{path[:200]}: no such cluster file; check the --cluster path"
                           ) from None
        except OSError as exc:  # e.g. a name longer than the file system allows
            raise CliError(f"{path[:200]}: cannot read the cluster file: "
                           f"{exc.strerror or exc}; check the --cluster path") from None
    try:
        return load_cluster(path)
    except (PlanningError, SpecError, ValueError, KeyError) as exc:
        text = _one_line(str(exc))
        # (a read or YAML error names the file already, with line and column)
        raise CliError(text if text.startswith(f"{path}") else f"{path}: {text}") from None


def with_profiles(inventory: Any, paths: Sequence[str]) -> Any:
    """The inventory with the device profiles in ``paths`` attached (``--profile``)."""
    from hettrain.planning.errors import PlanningError
    from hettrain.planning.profiles import apply_profiles, load_profile

    try:
        return apply_profiles(inventory, [load_profile(p) for p in paths])
    except PlanningError as exc:
        raise CliError(f"--profile {_one_line(str(exc))}") from None


def _plan_timeout(flag: float | None) -> float:
    """``--timeout-s``, else its default (:func:`hettrain.deadline.plan_timeout_default`); a
    bad ``HETTRAIN_PLAN_TIMEOUT_SECONDS`` is a :class:`CliError` naming it."""
    from hettrain.deadline import plan_timeout_default

    try:
        return plan_timeout_default(flag)
    except ValueError as exc:
        raise CliError(f"environment: {exc}; unset it or give --timeout-s") from None


def make_plan(name: str, spec: JobSpec, inventory: Any, exhaustive: bool, where: str,
              timeout_s: float = 0.0) -> Any:
    """Run the planner for at most ``timeout_s`` seconds (``0``: no limit); a
    ``PlanningError`` or the deadline becomes a :class:`CliError` with its reason."""
    from hettrain.deadline import PlanningTimeout, deadline
    from hettrain.planning.errors import PlanningError
    from hettrain.planning.planner import plan_job, search_time_hint
    from hettrain.planning.support import unsupported

    try:
        with deadline(timeout_s):
            plan = plan_job(name, spec, inventory, exhaustive=exhaustive)
    except PlanningError as exc:
        raise CliError(f"{where}: no plan ({exc.reason}): {_one_line(str(exc))}") from None
    except PlanningTimeout:
        raise CliError(
            f"{where}: no plan: planning took longer than --timeout-s {timeout_s:g} and was "
            "stopped; make the job smaller, pin spec.parallelism, or raise --timeout-s (the "
            "operator stops planning at HETTRAIN_PLAN_TIMEOUT_SECONDS, default 30)"
            + search_time_hint(spec)) from None
    refused = unsupported(plan)  # what the runtime would refuse at start-up
    if refused:
        raise CliError(f"{where}: the runtime cannot run this plan: {refused[0]}")
    return plan


# ---------------------------------------------------------------- subcommands


def cmd_plan(args: argparse.Namespace, out: IO[str]) -> int:
    """``hettrain plan``: plan one job on a cluster and print it (table or JSON), maybe draw it."""
    name, spec = load_job(args.job)
    inventory = with_profiles(load_inventory(args.cluster), args.profile or [])
    timeout_s = _plan_timeout(args.timeout_s)
    plan = make_plan(name, spec, inventory, args.exhaustive, args.job, timeout_s)
    picture = args.svg or args.png
    if picture:
        try:
            from hettrain.render.figure import render_plan_figure
        except ModuleNotFoundError as exc:
            raise CliError(f"--svg/--png need the Python package {exc.name!r}; install it with: "
                           "pip install 'hettrain[viz]'") from None
        try:
            render_plan_figure(plan, picture, fmt="svg" if args.svg else "png")
        except OSError as exc:
            raise CliError(f"{picture}: cannot write the picture: {exc.strerror or exc}") from None
    target = out
    where = f"--out {args.out}" if args.out else "standard output"
    try:
        if args.out:
            target = open(args.out, "w")  # noqa: SIM115 - closed below
        try:
            if args.json:
                target.write(plan.to_json(indent=2) + "\n")
            else:
                from hettrain.render.table import print_plan

                on_terminal = getattr(target, "isatty", lambda: False)()
                print_plan(plan, file=target, width=None if on_terminal else 140)
                if picture:
                    target.write(f"picture written to {picture}\n")
            target.flush()
        finally:
            if target is not out:
                target.close()
    except BrokenPipeError:
        raise
    except OSError as exc:  # a full disk, a directory, no permission
        raise CliError(f"{where}: cannot write: {exc.strerror or exc}") from None
    return EXIT_OK


def _emit(out: IO[str], text: str) -> None:
    """Write ``text`` to standard output; a full disk is a :class:`CliError`."""
    try:
        out.write(text)
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise CliError(f"standard output: cannot write: {exc.strerror or exc}") from None


def cmd_validate(args: argparse.Namespace, out: IO[str]) -> int:
    """``hettrain validate``: check every document (and plan each one with ``--cluster``)."""
    docs = load_yaml_documents(args.job)
    if not docs:
        raise CliError(f"{args.job}: holds no YAML documents; give at least one HetTrainingJob")
    inventory = load_inventory(args.cluster) if args.cluster else None
    timeout_s = _plan_timeout(args.timeout_s)
    errors: list[str] = []
    for i, doc in enumerate(docs, start=1):
        label = f"{args.job}[{i}]"
        try:
            name, spec = _parse_job_doc(doc)
        except SpecError as exc:
            errors.append(f"{label}: {_one_line(str(exc))}")
            continue
        label = f"{label} {name}"
        if inventory is None:
            _emit(out, f"OK {label}\n")
            continue
        try:
            plan = make_plan(name, spec, inventory, False, label, timeout_s)
        except CliError as exc:
            errors.append(str(exc))
            continue
        from hettrain.render.table import layout_summary

        _emit(out, f"OK {label}: DP×PP×TP {layout_summary(plan)} on {plan.world_size} GPUs, "
                   f"step {plan.predicted.step_time_s:.3f} s\n")
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return EXIT_USAGE if errors else EXIT_OK


# ---------------------------------------------------------------- external hooks


def _load_external(name: str, cmd: ExternalCommand) -> tuple[Any | None, str]:
    """(module, "") or (None, why it is unavailable)."""
    try:
        module = importlib.import_module(cmd.module)
    except ModuleNotFoundError as exc:
        if exc.name and (cmd.module == exc.name or cmd.module.startswith(exc.name + ".")):
            return None, (f"'hettrain {name}' is not available in this build "
                          f"(module {cmd.module} is missing)")
        return None, (f"'hettrain {name}' needs the Python package {exc.name!r}; "
                      f"install it with: pip install 'hettrain[{cmd.extra}]'")
    missing = [f for f in ("add_arguments", "run") if not callable(getattr(module, f, None))]
    if missing:
        return None, (f"'hettrain {name}' is not available: {cmd.module} lacks "
                      f"{' and '.join(missing)}()")
    return module, ""


def _unavailable(why: str) -> Callable[[argparse.Namespace, IO[str]], int]:
    def run(args: argparse.Namespace, out: IO[str]) -> int:
        raise CliError(why)

    run.ignores_arguments = True  # type: ignore[attr-defined]
    return run


def _external_runner(module: Any) -> Callable[[argparse.Namespace, IO[str]], int]:
    def run(args: argparse.Namespace, out: IO[str]) -> int:
        code = module.run(args)
        return EXIT_OK if code is None else int(code)

    return run


def _chosen_command(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


# ---------------------------------------------------------------- parser


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (exit 2), like every
    other bad-input error of the CLI; subcommand parsers inherit it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Raise :class:`CliError` ``PROG: MESSAGE; see PROG --help`` (:func:`main`: exit 2)."""
        raise CliError(f"{self.prog}: {_one_line(message)}; see {self.prog} --help")


def _add_timeout(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--timeout-s", type=float_in(0, 86400), metavar="SECONDS",
        help=f"stop planning{what} after SECONDS and exit 2 (0: no limit; default: the "
             "operator's budget, HETTRAIN_PLAN_TIMEOUT_SECONDS or 30)")


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argument parser; the hooked module of the subcommand named in ``argv`` is loaded."""
    from hettrain import __version__

    parser = OneLineParser(
        prog="hettrain",
        description="Plan and check LLM training jobs across heterogeneous, multi-vendor, "
                    "multi-datacenter GPU pools, offline.",
    )
    parser.add_argument("--version", action="version", version=f"hettrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    plan = sub.add_parser(
        "plan", help="compute the placement plan of a job on a cluster",
        description="Plan one HetTrainingJob on a cluster description and print the plan: one "
                    "row per pipeline stage, a summary with the predicted step time, tokens/s "
                    "and MFU, and the planner's notes.",
    )
    plan.add_argument("job", metavar="JOB.yaml", help="HetTrainingJob manifest (one document)")
    plan.add_argument("--cluster", required=True, metavar="CLUSTER.yaml",
                      help="cluster description (kind: Cluster), e.g. examples/clusters/*.yaml")
    plan.add_argument("--json", action="store_true",
                      help="print only the plan as JSON (what the operator stores in the "
                           "plan ConfigMap)")
    plan.add_argument("--exhaustive", action="store_true",
                      help="search every layout instead of the pruned search (slower)")
    pictures = plan.add_mutually_exclusive_group()
    pictures.add_argument("--svg", metavar="FILE",
                          help="also draw the placement map and pipeline schedule as SVG")
    pictures.add_argument("--png", metavar="FILE", help="same picture as PNG")
    plan.add_argument("--out", metavar="FILE", help="write the table or JSON to FILE, not stdout")
    plan.add_argument("--profile", action="append", metavar="FILE",
                      help="device profile from 'hettrain profile' (repeatable): measured layer "
                           "times for its device and model shape replace the catalog model")
    _add_timeout(plan, "")
    plan.set_defaults(func=cmd_plan)

    validate = sub.add_parser(
        "validate", help="check job manifests (and that they can be planned)",
        description="Check every HetTrainingJob in a (multi-document) YAML file with the spec "
                    "parser; with --cluster also plan each one. Prints OK per document, or every "
                    "error (one per document) on stderr and exits 2.",
    )
    validate.add_argument("job", metavar="JOB.yaml", help="one or more HetTrainingJob documents")
    validate.add_argument("--cluster", metavar="CLUSTER.yaml",
                          help="also plan each job on this cluster description")
    _add_timeout(validate, " each job (with --cluster)")
    validate.set_defaults(func=cmd_validate)

    chosen = _chosen_command(argv)
    for name, cmd in EXTERNAL_COMMANDS.items():
        sp = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if name != chosen:
            continue
        module, why = _load_external(name, cmd)
        if module is None:
            sp.description = f"{cmd.help}. Unavailable here: {why}."
            sp.set_defaults(func=_unavailable(why))
        else:
            module.add_arguments(sp)
            sp.set_defaults(func=_external_runner(module))
    return parser


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None) -> int:
    """Entry point of the ``hettrain`` script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out = out or sys.stdout
    try:
        parser = build_parser(argv)
        args, unknown = parser.parse_known_args(argv)
        if unknown and not getattr(args.func, "ignores_arguments", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        code = args.func(args, out)
        try:
            out.flush()  # a full disk fails here, not at exit with a traceback
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise CliError(f"standard output: cannot write: {exc.strerror or exc}") from None
        return code
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `hettrain plan ... | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
