"""The frontend's choice of which prompts skip the prefill hop (deployments/gateway/local_prefill.py): a lone short
prompt, and a burst reaching an idle pool within the decode replica's gather window, split between the decode
replica and the prefill replica by tokens (prompts of up to one step of the decode replica)."""

from __future__ import annotations

import pytest

from deployments.config import PlatformConfig
from deployments.gateway.local_prefill import LocalPrefill, LocalPrefillLimits

STD = LocalPrefillLimits(max_prompt_tokens=256, burst_window_s=0.100, burst_gap_s=0.030, burst_prompt_tokens=1024,
                         burst_seqs=32)


def _arrivals(policy: LocalPrefill, pool: str, prompts: list[int], spacing_s: float) -> list[bool]:
    """Requests of ``prompts`` tokens sent ``spacing_s`` apart, none finishing meanwhile."""
    return [policy.admit(pool, n, i, 100.0 + i * spacing_s) for i, n in enumerate(prompts)]


def test_a_burst_is_split_between_decode_and_prefill_by_tokens():
    assert _arrivals(LocalPrefill({"standard": STD}), "standard", [100] * 16, 0.004) == [True, False] * 8
    # by tokens, not by count: a 200-token prompt through prefill lets a second 100-token one go local
    got = _arrivals(LocalPrefill({"standard": STD}), "standard", [100, 200, 100, 100, 100], 0.004)
    assert got == [True, False, True, True, False]


def test_the_local_half_is_bounded_by_the_balance_and_max_num_seqs_not_by_one_step():
    got = _arrivals(LocalPrefill({"standard": STD}), "standard", [100] * 30, 0.001)
    assert got == [True, False] * 15  # 1,500 local tokens: more than one step, computed at the whole budget
    lim = LocalPrefillLimits(256, 1.0, 1.0, 10_000, 3)  # max_num_seqs 3
    assert sum(_arrivals(LocalPrefill({"p": lim}), "p", [10] * 12, 0.001)) == 3


def test_a_burst_of_long_prompts_is_split_but_a_lone_long_prompt_goes_through_prefill():
    # 1,000-token prompts (the median of the Azure traces): the first goes through prefill (it could be a lone
    # request), then local while the local tokens are no more than prefill's: half each; a prompt longer than one
    # step of the decode replica never goes local
    assert _arrivals(LocalPrefill({"standard": STD}), "standard", [1000] * 16, 0.004) == [False, True, True] + [
        False, True] * 6 + [False]
    assert _arrivals(LocalPrefill({"standard": STD}), "standard", [1000, 2000, 1000, 1025, 1000, 1000], 0.004) == [
        False, False, True, False, True, True]
    assert not LocalPrefill({"standard": STD}).admit("standard", 257, 0, 0.0)  # lone, over local_prefill_tokens
    assert not LocalPrefill({"p": LocalPrefillLimits(0, 1.0, 1.0, 1024, 32)}).admit("p", 10, 0, 0.0)  # 0 = off


def test_the_burst_ends_at_its_window_and_at_a_gap():
    # 10 ms apart: requests 0..10 are within the 100 ms window; from the 12th on, everything goes through prefill
    assert _arrivals(LocalPrefill({"standard": STD}), "standard", [20] * 16, 0.010) == [True, False] * 5 + [True] + [False] * 5
    # more than 30 ms after the last: the decode replica has started stepping, nothing more goes local
    assert _arrivals(LocalPrefill({"standard": STD}), "standard", [20] * 4, 0.031) == [True, False, False, False]


def test_a_long_prompt_goes_through_prefill_and_counts_for_that_side():
    assert _arrivals(LocalPrefill({"standard": STD}), "standard", [300] + [50] * 8, 0.001) == (
        [False] + [True] * 7 + [False])  # local while the local tokens are no more than prefill's 300


def test_an_idle_pool_starts_a_new_burst():
    policy = LocalPrefill({"standard": STD})
    assert _arrivals(policy, "standard", [100] * 3, 0.2) == [True, False, False]  # past the window
    assert policy.admit("standard", 100, 0, 200.0)  # everything finished: a new burst


def test_without_a_decode_gather_window_only_a_lone_request_goes_local():
    hs = LocalPrefillLimits(max_prompt_tokens=256)  # highspeed: its decode replicas do not gather
    policy = LocalPrefill({"highspeed": hs})
    assert _arrivals(policy, "highspeed", [10] * 3, 0.0) == [True, False, False]
    assert not policy.admit("standard", 10, 0, 0.0)  # a pool not named: always through prefill
    assert not LocalPrefill({"p": LocalPrefillLimits(0)}).admit("p", 1, 0, 0.0)  # 0 = off


def test_limits_follow_the_pool_config():
    pools = PlatformConfig().pools
    std, hs = LocalPrefillLimits.of_pool(pools["standard"]), LocalPrefillLimits.of_pool(pools["highspeed"])
    s = pools["standard"]
    assert (std.max_prompt_tokens, std.burst_window_s, std.burst_gap_s, std.burst_prompt_tokens, std.burst_seqs) == (
        s.local_prefill_tokens, s.decode_gather_wait_ms / 1e3, s.decode_gather_gap_ms / 1e3, s.max_num_batched_tokens,
        s.max_num_seqs)
    assert hs.burst_window_s == 0 and hs.max_prompt_tokens == pools["highspeed"].local_prefill_tokens
    with pytest.raises(ValueError, match="burst_gap_s must be >= 0, got -1"):
        LocalPrefillLimits(10, burst_gap_s=-1)
