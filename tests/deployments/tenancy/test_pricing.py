"""Pricing: a pool's USD-per-million price table as integer pico-USD per token, and a request's exact cost."""

from __future__ import annotations

from fractions import Fraction

import pytest

from deployments.config import PlatformConfig, PriceConfig
from deployments.gateway.protocol import Finished, Usage, total_usage
from deployments.tenancy.pricing import Price, format_usd, per_task_usd, pico_per_token, prices_of, usd


def test_prices_are_whole_pico_usd_per_token():
    assert pico_per_token(0.60) == 600_000
    assert pico_per_token(2.5) == 2_500_000
    assert pico_per_token(0.000001) == 1
    assert pico_per_token(0) == 0
    with pytest.raises(ValueError, match=r"input price 1e-07 USD per million tokens must be >= 0 with at most 6 decimals"):
        pico_per_token(1e-7, "input price")
    with pytest.raises(ValueError, match="at most 6 decimals"):
        Price.of(PriceConfig(input=0.1234567))


def test_cost_is_uncached_input_plus_cached_plus_output():
    price = Price.of(PriceConfig(input=0.60, cached_input=0.15, output=2.50))
    cost = price.cost(prompt_tokens=100, cached_tokens=64, output_tokens=7)
    assert (cost.input_tokens, cost.cached_tokens, cost.output_tokens) == (36, 64, 7)
    assert (cost.input_pico, cost.cached_pico, cost.output_pico) == (36 * 600_000, 64 * 150_000, 7 * 2_500_000)
    assert cost.total_pico == 21_600_000 + 9_600_000 + 17_500_000 == 48_700_000
    assert cost.usd() == float(Fraction(48_700_000, 10**12)) == 4.87e-05
    assert cost.details_usd() == {"input": 2.16e-05, "cached_input": 9.6e-06, "output": 1.75e-05}
    with pytest.raises(ValueError, match=r"0 <= cached \(5\) <= prompt \(4\)"):
        price.cost(4, 5, 0)


def test_default_pools_price_highspeed_on_its_own():
    prices = prices_of(PlatformConfig().pools)
    assert prices == {"standard": Price(600_000, 150_000, 2_500_000), "highspeed": Price(2_400_000, 600_000, 10_000_000)}


def test_total_usage_charges_the_prompt_once_and_every_choice():
    price = Price(600_000, 150_000, 2_500_000)
    fins = [Finished("length", Usage(10, n, 4, 0.1, 1.0, 1.0, price=price), "m", "standard", "r", index=i)
            for i, n in enumerate((3, 5))]
    cost = total_usage(fins).cost
    assert cost.total_pico == 6 * 600_000 + 4 * 150_000 + 8 * 2_500_000
    assert Usage(1, 1, 0, 0, 0, 0).cost is None  # not priced


def test_rendering():
    assert usd(1) == 1e-12
    assert usd(10**12 * 3) == 3.0
    assert per_task_usd(10, 0) is None
    assert per_task_usd(10, 3) == float(Fraction(10, 3 * 10**12))
    assert format_usd(48_700_000) == "0.000048700000"
    assert format_usd(10, 4) == "0.000000000002"  # 2.5 pico: half even
    assert format_usd(10**13, 3) == "3.333333333333"
