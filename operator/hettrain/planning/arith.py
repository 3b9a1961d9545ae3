"""Integer arithmetic for the planner whose cost does not grow with the numbers themselves.

``globalBatch`` may be 10^8 (or any int64 on the API): the data-parallel degrees are its
divisors, found here by factorisation (trial division by small primes, then Miller-Rabin and
Pollard's rho for what is left) and enumerated only up to a cap (no more replicas than GPUs),
never by a loop over ``1..n``.
"""

from __future__ import annotations

import math
from collections import Counter

_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
_TRIAL_LIMIT = 1000


def is_prime(n: int) -> bool:
    """Miller-Rabin with the first 13 prime bases: exact for ``n < 3.3·10^24``."""
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _SMALL_PRIMES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _pollard_rho(n: int) -> int:
    """A non-trivial factor of the odd composite ``n`` (Brent's variant)."""
    for c in range(1, n):
        y, r, q, g = 2, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(128, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += 128
            r *= 2
        if g == n:
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise ArithmeticError(f"no factor found for {n}")  # unreachable for composite n


def prime_factors(n: int) -> Counter[int]:
    """Prime factorisation of ``n ≥ 1`` as ``{prime: exponent}``."""
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    out: Counter[int] = Counter()
    for p in range(2, _TRIAL_LIMIT):
        if p * p > n:
            break
        while n % p == 0:
            out[p] += 1
            n //= p
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if m < _TRIAL_LIMIT * _TRIAL_LIMIT or is_prime(m):
            out[m] += 1  # no factor below the trial limit is left, so m < limit² is prime
        else:
            f = _pollard_rho(m)
            stack.extend((f, m // f))
    return out


def divisors_up_to(n: int, limit: int) -> list[int]:
    """The divisors ``d ≤ limit`` of ``n ≥ 1``, ascending (products pruned at ``limit``)."""
    divs = [1]
    for p, e in sorted(prime_factors(n).items()):
        grown = []
        for d in divs:
            x = d
            for _ in range(e):
                x *= p
                if x > limit:
                    break
                grown.append(x)
        divs.extend(grown)
    return sorted(d for d in divs if d <= limit)


def uneven_dp_values(n: int, limit: int) -> list[int]:
    """The replica counts ``q = ceil(n / m)`` for ``m ≥ 2`` that do not divide ``n``, up to
    ``limit``, ascending: the fewest replicas that share ``n`` items with at most ``m`` each
    (the others run ``m − 1``). One value per distinct quotient (``O(√n)`` of them), found
    by jumping from each ``q`` to the first ``m`` with a smaller one."""
    out = []
    m = 2
    while m <= n:
        q = -(-n // m)
        if q <= limit and n % q:
            out.append(q)
        if q == 1:
            break
        m = -(-n // (q - 1))  # the first m with ceil(n / m) <= q - 1
    return sorted(out)


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """Split ``n`` items into ``shards`` contiguous ranges (the first ``n % shards`` one
    longer): a flat buffer's shards in the runtime, a layer range's stages in the planner."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    base, extra = divmod(n, shards)
    out, start = [], 0
    for j in range(shards):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out
