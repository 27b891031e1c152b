"""The simulated weight sync (`rollart/sim/weight_sync.py`): a star costs the trainer's egress a copy per
generator, a relay one copy whatever their number, and the times follow the pipelining formulas,
computed here by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart.sim.config import SimSpec, SimTrainerSpec
from rollart.sim.hardware import MODELS, EngineShape, transfer_s
from rollart.sim.weight_sync import Links, Place, engine_places, plan_senders, sync_times

MIB = 1 << 20
B = 64 * MIB
GBPS = 200.0
W = GBPS * 1e9 / 8  # bytes per second
SAME = Links(cross_gbps=GBPS, cluster_gbps=GBPS, host_gbps=GBPS)
"""Every link the same, so the formulas have one W."""


def hosts(n: int, cluster: str = "generation") -> list[Place]:
    return [Place(cluster, f"host{i}") for i in range(n)]


@pytest.mark.parametrize("n", [8, 32])
def test_relay_trainer_egress_is_one_state_dict_while_a_star_sends_n(n: int) -> None:
    state = MODELS["qwen3-32b"].weight_bytes
    star = sync_times(state, hosts(n), "star")
    relay = sync_times(state, hosts(n), "relay")
    tree = sync_times(state, hosts(n), "relay", fanout=4)
    assert star.trainer_egress_bytes == n * state and star.egress_copies == n
    assert relay.trainer_egress_bytes == state and relay.egress_copies == 1
    assert tree.egress_copies == 1
    # the star's copies share the trainer's link: every one lands at N x S / W
    assert star.last_s == pytest.approx(n * state / W)
    assert star.trainer_busy_s == pytest.approx(star.last_s)
    # the relay's trainer is free after one copy, whatever N is
    assert relay.trainer_busy_s == pytest.approx(state / W)


@pytest.mark.parametrize("n", [2, 8, 32])
def test_relay_chain_delivers_the_last_byte_at_s_plus_n_minus_1_buckets_over_w(n: int) -> None:
    state = 100 * B  # a whole number of buckets
    chain = sync_times(state, hosts(n), "relay", bucket_bytes=B, links=SAME)
    assert chain.last_s == pytest.approx((state + (n - 1) * B) / W)
    assert chain.depth == n
    # generator k (k hops out) holds it (k - 1) buckets after the first
    assert sorted(chain.arrival_s) == pytest.approx([(state + k * B) / W for k in range(n)])


def test_relay_chain_with_a_slow_first_hop_pays_it_once() -> None:
    """Trainer -> first generator across clusters (200 Gb/s), then InfiniBand (400 Gb/s) hops: the
    cross-cluster copy, plus one bucket per further hop at the faster rate."""
    state, n = 100 * B, 32
    chain = sync_times(state, hosts(n), "relay", bucket_bytes=B, links=Links(cross_gbps=200, cluster_gbps=400))
    assert chain.last_s == pytest.approx(state / W + (n - 1) * B / (2 * W))


def test_relay_bucket_that_is_not_whole_ends_smaller() -> None:
    state = 10.5 * B
    chain = sync_times(state, hosts(3), "relay", bucket_bytes=B, links=SAME)
    # the half bucket queues behind the last full one at every hop: (S + (N - 1) b) / W still holds
    assert chain.last_s == pytest.approx((state + 2 * B) / W)


def test_relay_and_star_at_one_generator_are_the_same_push() -> None:
    state = MODELS["qwen3-32b"].weight_bytes
    star, relay = sync_times(state, hosts(1), "star"), sync_times(state, hosts(1), "relay")
    assert star == relay
    assert star.last_s == pytest.approx(transfer_s(MODELS["qwen3-32b"], gbps=200))


@pytest.mark.parametrize(("fanout", "n", "depth"), [(2, 7, 3), (3, 13, 3), (4, 21, 3), (2, 31, 5)])
def test_relay_tree_depth_and_time_of_a_full_tree(fanout: int, n: int, depth: int) -> None:
    """A full tree of `depth` levels (1 + k + ... + k^(depth-1) = n generators): the trainer's hop at W,
    every inner hop at W / k (the sender's link split among its k children), so the last byte lands
    at (b + k (B + depth - 2) b) / W for B buckets."""
    assert sum(fanout**level for level in range(depth)) == n
    buckets = 50
    tree = sync_times(buckets * B, hosts(n), "relay", fanout=fanout, bucket_bytes=B, links=SAME)
    assert tree.depth == depth
    assert tree.last_s == pytest.approx((B + fanout * (buckets + depth - 2) * B) / W)
    senders = plan_senders(hosts(n), "relay", fanout=fanout)
    assert [senders.count(v) for v in range(n)].count(fanout) == (n - 1) // fanout  # inner nodes: k children each


def test_relay_plan_crosses_each_cluster_once_and_starts_in_the_trainers_cluster() -> None:
    places = [Place("far", "f1"), Place("near", "n0"), Place("far", "f0"), Place("training", "t0"), Place("near", "n1")]
    senders = plan_senders(places, "relay")
    assert senders == [2, 0, 3, -1, 1]  # training t0 -> far f0 -> far f1 -> near n0 -> near n1
    chain_hops = sum(1 for v, s in enumerate(senders) if s >= 0 and places[s].cluster != places[v].cluster)
    assert chain_hops == 2  # training -> far, far -> near


def test_relay_replicas_that_share_a_host_relay_over_the_host() -> None:
    """Engines of 2 GPUs fill hosts of 8 four at a time; the chain leaves each host once."""
    places = engine_places({"gen": EngineShape(gpu="H20", gpus=2, replicas=8)})
    assert [place.host for _, place in places] == ["gen/0"] * 4 + ["gen/1"] * 4
    state = 100 * B
    links = Links(cross_gbps=200, cluster_gbps=400, host_gbps=3200)
    chain = sync_times(state, [place for _, place in places], "relay", bucket_bytes=B, links=links)
    fast, slow = B / (3200e9 / 8), B / (400e9 / 8)
    assert chain.last_s == pytest.approx(state / W + 6 * fast + slow)


def test_relay_plan_is_checked_where_the_config_is_loaded() -> None:
    spec = SimSpec(trainer=SimTrainerSpec(plan="relay", relay_fanout=0, bucket_mb=0, cluster_gbps=0))
    problems = dict(spec.validate())
    assert set(problems) == {"trainer.relay_fanout", "trainer.bucket_mb", "trainer.cluster_gbps"}


def test_relay_reaches_the_simulated_trainer_step_which_times_a_node_by_its_last_replica(tmp_path: Path) -> None:
    from rollart.nodes.trainer_rollout_only import SimulatedStep
    from rollart.rundir import RunDir

    generators = {
        "gen-h800": EngineShape(gpu="H800", gpus=8, replicas=4),
        "gen-h20": EngineShape(gpu="H20", gpus=8, replicas=4),
    }
    state = MODELS["qwen3-32b"].weight_bytes
    for plan, copies in (("star", 8), ("relay", 1)):
        sim = SimSpec(trainer=SimTrainerSpec(plan=plan))
        step = SimulatedStep(None, None, RunDir(tmp_path), sim=sim, generators=generators, clients={})  # type: ignore[arg-type]
        assert step.sync.egress_copies == copies
        places = [place for _, place in engine_places(generators)]
        expected = sync_times(state, places, plan).arrival_s
        by_node = {
            name: max(a for (n, _), a in zip(engine_places(generators), expected, strict=True) if n == name)
            for name in generators
        }
        assert step.arrival_s == by_node
        assert max(step.arrival_s.values()) == step.sync.last_s
    # relay: the chain, planned by host name, starts on the H20 hosts, which hold it first
    assert step.arrival_s["gen-h20"] < step.arrival_s["gen-h800"]
