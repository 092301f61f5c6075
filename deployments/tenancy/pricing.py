"""What a request costs, exactly: integer pico-USD from a pool's price table.

A pool's :class:`~deployments.config.PriceConfig` gives USD per million tokens (input,
cached input, output). One pico-USD (1e-12 USD) per token is 1e-6 USD per million tokens,
so a price with at most six decimals is a whole number of pico-USD per token
(:class:`Price`), and a request's cost is integer arithmetic: uncached prompt tokens ×
input + cached prompt tokens × cached_input + output tokens × output. Everything that adds
costs up (the usage ledger, Redis) adds these integers; USD floats are only rendered for
clients (:func:`usd`), never summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Protocol

PICO_PER_USD = 10**12
PICO_PER_TOKEN_PER_USD_PER_MTOK = 10**6  # 1 USD per million tokens = 1e6 pico-USD per token


class _PriceTable(Protocol):  # deployments.config.PriceConfig (not imported: config imports the gateway)
    input: float
    cached_input: float
    output: float


def pico_per_token(usd_per_million: float, what: str = "price") -> int:
    """``usd_per_million`` (USD per million tokens) as whole pico-USD per token; a price with more
    than six decimals (finer than a pico-USD per token) or a negative one is a ValueError naming it."""
    exact = Decimal(str(usd_per_million)) * PICO_PER_TOKEN_PER_USD_PER_MTOK
    if exact < 0 or exact != exact.to_integral_value():
        raise ValueError(f"{what} {usd_per_million!r} USD per million tokens must be >= 0 with at most 6 decimals "
                         "(a whole number of pico-USD per token)")
    return int(exact)


@dataclass(frozen=True, slots=True)
class Cost:
    """The tokens a request was charged for and what each kind cost, pico-USD (integers).

    ``input_tokens`` are prompt tokens computed (not served from the cache); ``cached_tokens``
    prompt tokens served from cached state; input_tokens + cached_tokens = prompt tokens."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    input_pico: int = 0
    cached_pico: int = 0
    output_pico: int = 0

    @property
    def total_pico(self) -> int:
        return self.input_pico + self.cached_pico + self.output_pico

    def usd(self) -> float:
        return usd(self.total_pico)

    def details_usd(self) -> dict[str, float]:
        """The parts in USD, keyed as ``usage.cost_details``: input, cached_input, output."""
        return {"input": usd(self.input_pico), "cached_input": usd(self.cached_pico), "output": usd(self.output_pico)}


NO_COST = Cost()


@dataclass(frozen=True, slots=True)
class Price:
    """One pool's price table in pico-USD per token."""

    input: int
    cached_input: int
    output: int

    @classmethod
    def of(cls, table: _PriceTable) -> "Price":
        return cls(pico_per_token(table.input, "input price"), pico_per_token(table.cached_input, "cached_input price"),
                   pico_per_token(table.output, "output price"))

    def cost(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> Cost:
        """What a request with these tokens costs (``cached_tokens`` of the ``prompt_tokens`` came from the cache)."""
        if not 0 <= cached_tokens <= prompt_tokens or output_tokens < 0:
            raise ValueError(f"token counts must satisfy 0 <= cached ({cached_tokens}) <= prompt ({prompt_tokens}) "
                             f"and output ({output_tokens}) >= 0")
        computed = prompt_tokens - cached_tokens
        return Cost(computed, cached_tokens, output_tokens, computed * self.input, cached_tokens * self.cached_input,
                    output_tokens * self.output)


def prices_of(pools: dict) -> dict[str, Price]:
    """pool name → :class:`Price`, from ``PlatformConfig.pools`` (each ``PoolConfig.price``)."""
    return {name: Price.of(pc.price) for name, pc in pools.items()}


def usd(pico: int) -> float:
    """pico-USD as the nearest float USD (what JSON and protobuf carry)."""
    return float(Fraction(pico, PICO_PER_USD))


def per_task_usd(pico: int, tasks: int) -> float | None:
    """``pico`` spread over ``tasks`` as the nearest float USD; None without tasks."""
    return None if tasks == 0 else float(Fraction(pico, PICO_PER_USD * tasks))


def format_usd(pico: int, tasks: int = 1) -> str:
    """``pico / tasks`` pico-USD as a USD string to the pico-USD (12 decimals, rounded half even): the table's form."""
    return f"{Decimal(pico) / Decimal(tasks) / PICO_PER_USD:.12f}"
