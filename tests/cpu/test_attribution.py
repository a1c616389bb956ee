"""`check logprobs --attribute` (issue 55): the mismatch split into a chain of links, checks/attribution.py.

The chain's arithmetic on made-up states (links add up, shares, spans not split, links not measured, the all-zero
verdict with its counts), then each planted cause on a real run, landing in its own link with at least 80% of the
measured mismatch: the engine's dtype (bf16 against the float32 trainer) and its fp8 weights in `dtype`, a stale
weight version (--async one-step) in `weights`, a top-p nucleus the engine renormalises over in `definition`, a
batch-variant engine kernel and prefix reuse that changes bits (the reused prompt attended apart, merged) in
`cache`. The seeds are the small config's (seed 1, fixed before any of this was
written); bench/attribution.py runs every cause over three seeds and docs/benchmarks.md says how many pass.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlbench.checks.attribution import LINK_NAMES, STATES, StepStates, attribute
from rlbench.errors import BadInput
from tests.conftest import cli


def _step(values: dict[str, list[float]], step: int = 0, measured: dict[str, list[bool]] | None = None) -> StepStates:
    n = len(next(iter(values.values())))
    out = StepStates(step, torch.tensor([[0, k, 5] for k in range(n)]))
    for state, v in values.items():
        mask = None if measured is None or state not in measured else torch.tensor(measured[state])
        out.put(state, torch.tensor(v, dtype=torch.float64), mask)
    return out


def _chain(*per_state: float) -> dict[str, list[float]]:
    return {state: [value] for state, value in zip(STATES, per_state)}


def test_links_add_up_to_the_mismatch_token_by_token_and_shares_to_one():
    values = _chain(-1.0, -1.25, -1.25, -1.0, -2.0, -2.0, -2.5, -2.5)
    found = attribute([_step(values)])
    by_name = {link.name: link for link in found.links}
    assert [link.name for link in found.links] == list(LINK_NAMES)
    assert by_name["cache"].mean_abs == 0.25 and by_name["dtype"].mean_abs == 0.25
    assert by_name["weights"].mean_abs == 1.0 and by_name["definition"].mean_abs == 0.5
    assert found.total.tokens == 1 and found.total.mean_abs == 1.5
    assert sum(link.share for link in found.links) == pytest.approx(1.0)
    assert by_name["weights"].share == pytest.approx(1.0 / 2.0)
    assert found.largest == "weights" and not found.all_zero
    assert [(w.before, w.after, w.delta) for w in found.worst] == [(-1.0, -2.0, -1.0)]


def test_every_link_zero_is_said_with_the_tokens_each_compared():
    found = attribute([_step({state: [-0.5, -0.25] for state in STATES}), _step({s: [-1.0] for s in STATES}, 1)])
    assert found.all_zero and found.largest is None and found.worst == []
    assert all(link.tokens == 3 and link.mean_abs == 0 and link.share == 0 for link in found.links)
    assert found.total.tokens == 3 and not found.not_measured


def test_a_state_missing_between_two_makes_a_span_not_split_never_folded_into_a_link():
    values = _chain(-1.0, -1.5, -1.5, -1.5, -1.5, -1.5, -1.5, -1.5)
    step = _step(values, measured={"engine": [False]})
    step.reasons["engine"] = "no engine to ask"
    found = attribute([step])
    assert [link.name for link in found.links][:1] == ["cache+kernels"]
    span = found.links[0]
    assert span.mean_abs == 0.5 and span.share == 1.0 and span.reasons == ["engine: no engine to ask"]
    assert "cache" not in {link.name for link in found.links} and not found.not_measured
    assert found.largest == "cache+kernels"


def test_a_link_measured_on_some_tokens_only_counts_those_and_the_rest_in_a_span():
    values = {state: [-1.0, -1.0] for state in STATES}
    values["decode"] = [-1.25, -2.0]
    step = _step(values, measured={"engine": [True, False]})
    found = attribute([step])
    by_name = {link.name: link for link in found.links}
    assert by_name["cache"].tokens == 1 and by_name["cache"].mean_abs == 0.25
    assert by_name["cache+kernels"].tokens == 1 and by_name["cache+kernels"].mean_abs == 1.0
    assert by_name["kernels"].tokens == 1 and by_name["dtype"].tokens == 2


def test_a_state_measured_nowhere_at_the_chain_end_leaves_its_link_not_measured_with_the_reason():
    values = {state: [-1.0] for state in STATES if state != "recorded"}
    step = _step(values)
    step.reasons["recorded"] = "a rollout-only run records no trainer log-probs"
    found = attribute([step])
    assert [link.name for link in found.not_measured] == ["residual"]
    assert found.not_measured[0].reasons == ["recorded: a rollout-only run records no trainer log-probs"]
    assert found.total.tokens == 0  # no recorded trainer log-prob: no whole mismatch to speak of


def test_the_worst_tokens_are_the_largest_links_largest_deltas_earliest_first_among_equals():
    values = {state: [-1.0, -1.0, -1.0] for state in STATES}
    values["decode"] = [-1.5, -1.0, -1.5]
    values["engine"] = values["decode"]
    values["forward"] = values["decode"]
    found = attribute([_step(values)], top=2)
    assert found.largest == "dtype"
    assert [(w.response_token, w.delta) for w in found.worst] == [(0, 0.5), (2, 0.5)]


def _attributed(path) -> dict:
    done = cli("check", "logprobs", str(path), "--attribute", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _share(found: dict, name: str) -> float:
    return next(link["share"] for link in found["links"] if link["names"] == [name])


@pytest.mark.parametrize(
    ("link", "overrides"),
    [
        ("dtype", {"rollout__dtype": "bfloat16"}),
        ("dtype", {"rollout__quantization": "fp8"}),
        ("weights", {"rollout__async_mode": "one-step"}),
        ("definition", {"rollout__logprobs": "filtered", "rollout__top_p": 0.9}),
        ("cache", {"rollout__batch_invariant": False}),
        ("cache", {"rollout__prefix_invariant": False}),
    ],
    ids=["engine-bf16", "engine-fp8", "stale-version", "engine-top-p", "batch-variant-kernel", "prefix-reuse"],
)
def test_a_planted_cause_gets_at_least_80_percent_of_the_mismatch_in_its_own_link(
    run_small, tmp_path, unchanged, link, overrides
):
    run_small("planted", steps=2, checkpoint_every=1, **overrides)
    found = _attributed(tmp_path / "planted")
    assert found["largest"] == link and _share(found, link) >= 0.8, found["links"]
    assert not found["not_measured"]
    assert all(entry["tokens"] == found["tokens"] for entry in found["links"])  # every link over every token
    # the cause made a mismatch, in its link, that the same run without it has not
    assert _mean(found, link) > _mean(unchanged, link) and found["total"]["mean_abs"] > unchanged["total"]["mean_abs"]


@pytest.fixture(scope="module")
def unchanged(small_config, tmp_path_factory) -> dict:
    """The attribution of the planted runs' config without a cause (2 steps, a checkpoint every step)."""
    from rlbench.config import apply_overrides
    from rlbench.session import run

    out = tmp_path_factory.mktemp("unchanged") / "run"
    run(apply_overrides(small_config, out=str(out), steps=2, checkpoint_every=1))
    return _attributed(out)


def _mean(found: dict, name: str) -> float:
    return next(link["mean_abs"] for link in found["links"] if link["names"] == [name])


@pytest.mark.parametrize("plant", ["batch_invariant", "prefix_invariant"])
def test_a_planted_engine_kernel_changes_the_engines_decode_and_nothing_after_it(run_small, tmp_path, plant):
    """The planted batch-variant kernel, or the reused prompt attended apart, moves the decode's log-probs (against the
    same run without it) while the states after it are the same bits: it is the cache link's doing."""
    run_small("invariant", steps=1, checkpoint_every=1)
    run_small("variant", steps=1, checkpoint_every=1, **{f"rollout__{plant}": False})
    from rlbench.rundir import recording

    a, b = (recording.read_step(tmp_path / name, 0)[0] for name in ("invariant", "variant"))
    assert torch.equal(a["tokens"], b["tokens"])
    assert not torch.equal(a["rollout_logprobs"], b["rollout_logprobs"])
    assert torch.equal(a["old_logprobs"], b["old_logprobs"])


def test_an_async_runs_lag_is_the_weights_link_and_its_step_without_lag_has_none(run_small, tmp_path):
    run_small("async", steps=2, checkpoint_every=1, rollout__async_mode="one-step")
    found = _attributed(tmp_path / "async")
    weights = {row["step"]: row["links"]["weights"]["mean_abs"] for row in found["per_step"]}
    assert weights[0] == 0 and weights[1] > 1e-3
    note = next(link["notes"] for link in found["links"] if link["names"] == ["weights"])
    assert note == ["weights = dtype: the engine sampled with the weights trained (steps [0])"]


def test_the_default_run_compares_every_link_on_every_token_and_true_on_policy_makes_every_link_zero(
    run_small, tmp_path
):
    run_small("default", steps=1, checkpoint_every=1)
    found = _attributed(tmp_path / "default")
    assert [link["names"] for link in found["links"]] == [[name] for name in LINK_NAMES]
    assert all(link["tokens"] == found["tokens"] > 0 for link in found["links"])
    # the engine's cached, batched decode against its one forward: float32 rounding, nowhere else
    assert found["largest"] == "cache" and _share(found, "cache") == 1.0
    run_small("on-policy", steps=1, checkpoint_every=1, rollout__true_on_policy=True)
    done = cli("check", "logprobs", str(tmp_path / "on-policy"), "--attribute")
    assert done.returncode == 0, done.stderr
    tokens = _attributed(tmp_path / "on-policy")["tokens"]
    counts = ", ".join(f"{name} {tokens}" for name in LINK_NAMES)
    assert f"every link is 0 (tokens compared: {counts})" in " ".join(done.stdout.split())


def test_a_step_without_the_checkpoint_of_its_weights_is_named_not_measured(run_small, tmp_path):
    run_small("sparse", steps=2, checkpoint_every=2)  # checkpoints 0 and 2: step 1's weights are in neither
    found = _attributed(tmp_path / "sparse")
    step1 = next(row for row in found["per_step"] if row["step"] == 1)
    assert set(step1["links"]) == {"cache+kernels+dtype+weights+micro_batch+definition+residual"}
    span = next(link for link in found["links"] if len(link["names"]) == 7)
    assert any("no checkpoint of weight version(s) [1]" in reason for reason in span["reasons"])


def test_options_of_the_attribution_are_refused_without_it_and_gates_with_it(run_small, tmp_path):
    run_small("r", steps=1, checkpoint_every=1)
    for args, field in (
        (["--steps", "0:1"], "--steps"),
        (["--engine-url", "http://127.0.0.1:1"], "--engine-url"),
        (["--attribute", "--max-mean", "0.1"], "--max-mean"),
        (["--attribute", "--engine-load-weights"], "--engine-load-weights"),
    ):
        done = cli("check", "logprobs", str(tmp_path / "r"), *args)
        assert done.returncode == 2 and field in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)


def test_zero_judged_tokens_is_undetermined_not_a_verdict(run_small, tmp_path, monkeypatch):
    run_small("r", steps=1, checkpoint_every=1)
    import rlbench.checks.attribution_run as attribution_run

    monkeypatch.setattr(attribution_run, "judged_samples", lambda samples: ([False] * len(samples), 0, 0))
    with pytest.raises(BadInput, match="undetermined: no judged token"):
        attribution_run.attribute_run(tmp_path / "r")


@pytest.fixture(scope="module")
def server():
    """`rlbench serve` as a process of its own, as a user starts it: the fixture model's shape from seeded random
    weights (every run against it pushes its own first); its URL."""
    from tests.conftest import RANDOM_INIT_MODEL
    from tests.helpers import serve_process

    with serve_process("--model-path", str(RANDOM_INIT_MODEL), "--load-format", "dummy") as url:
        yield url


def _figures(found: dict) -> list:
    return [(link["names"], link["tokens"], link["mean_abs"]) for link in found["links"]]


def test_the_engine_side_through_a_servers_http_api_agrees_with_the_in_process_measurement(run_small, tmp_path, server):
    """A run against `rlbench serve` started as a process of its own; its attribution with the engine state asked of
    that server over SGLang's native API (--engine-url) equals the one that rebuilds the engine in this process,
    link for link; without --engine-load-weights the samples of a version the server no longer holds are not
    measured there, and the cache and kernels links are given together, not split, with the reason."""
    url = server
    address = url.removeprefix("http://")
    run_small(
        "ext",
        steps=2,
        checkpoint_every=1,
        rollout__backend="sglang",
        rollout__external_engine_addrs=(address,),
        rollout__use_router=False,
    )
    here = _attributed(tmp_path / "ext")
    args = ("check", "logprobs", str(tmp_path / "ext"), "--attribute", "--json", "--engine-url", url)
    held = cli(*args)
    loaded = cli(*args, "--engine-load-weights")
    assert held.returncode == 0 and loaded.returncode == 0, held.stderr + loaded.stderr
    loaded, held = json.loads(loaded.stdout), json.loads(held.stdout)
    assert _figures(loaded) == _figures(here) and loaded["per_step"] == here["per_step"]
    assert loaded["engine"] == url and here["engine"].startswith("embedded hf engine")
    span = next(link for link in held["links"] if link["names"] == ["cache", "kernels"])
    assert span["tokens"] == here["tokens"]  # samples of versions 0 and 1; the server holds the run's last, 2
    assert span["reasons"] == [
        "engine: the server answered with weight version '2', not the one the samples were drawn with "
        "(--engine-load-weights loads it)"
    ]


def test_a_slime_dump_directory_gets_the_trainer_side_links_and_names_the_engines_not_measured(tmp_path):
    """examples/slime-dump-details (slime's own writers; its log-probs are not this model's): no engine to ask, so
    the cache and kernels links are one span not split, with the reason; the trainer-side links are computed with
    the import's model in the train dump's micro-batches, and what that forward does not reproduce of slime's
    recorded log-probs is the residual, never another link."""
    from tests.conftest import REPO

    found = _attributed(REPO / "examples" / "slime-dump-details")
    names = [link["names"] for link in found["links"]]
    assert names[0] == ["cache", "kernels"] and names[1:] == [[n] for n in LINK_NAMES[2:]]
    assert found["links"][0]["reasons"] == ["engine: a slime dump holds no engine to ask (--engine-url asks a server)"]
    assert found["engine"] == "none (a slime dump)" and "train dump's micro-batches" in found["trainer"]
    assert all(link["tokens"] == found["tokens"] == found["total"]["tokens"] > 0 for link in found["links"])
    assert found["largest"] in ("cache+kernels", "residual")
    assert sum(link["share"] for link in found["links"]) == pytest.approx(1.0)


def test_a_sync_that_leaves_one_tensor_behind_is_the_weights_link(run_small, tmp_path, monkeypatch, server):
    """A run against `rlbench serve` (its own process) whose first sync leaves one tensor at the value the server
    held before (its seeded random one, or a run's before this one), as a partial update does, with the
    weight-update check off (with it on, the run stops there). The server still holds that version (no later sync:
    --async one-step, an interval of 2), so the attribution asks it: the server's hashes name the tensor, forward
    and dtype hold it as the server does, and the trainer's weights put it back: the weights link gets the
    mismatch."""
    import urllib.request

    from rlbench.backends.sglang.engine import SGLangEngine

    behind, url = "model.layers.0.mlp.down_proj.weight", server
    request = urllib.request.Request(
        url + "/get_weights_by_name",
        data=json.dumps({"name": behind, "truncate_size": 2**31 - 1}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        old = torch.tensor(json.loads(answer.read()), dtype=torch.float32)
    write = SGLangEngine._write

    def partial(self, weights, version):
        return write(self, {**weights, behind: old}, version)

    monkeypatch.setattr(SGLangEngine, "_write", partial)
    run_small(
        "damaged",
        steps=1,
        checkpoint_every=1,
        rollout__backend="sglang",
        rollout__external_engine_addrs=(url.removeprefix("http://"),),
        rollout__use_router=False,
        rollout__verify_engine_weights=False,
        rollout__async_mode="one-step",
        rollout__update_weights_interval=2,
    )
    done = cli("check", "logprobs", str(tmp_path / "damaged"), "--attribute", "--json", "--engine-url", url)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["largest"] == "weights" and _share(found, "weights") >= 0.8, found["links"]
    assert not found["not_measured"] and all(link["tokens"] == found["tokens"] for link in found["links"])
    assert any(behind in note and "version 0" in note for note in found["notes"]), found["notes"]


def test_a_token_with_a_state_not_a_finite_number_is_left_out_of_every_figure_and_named():
    values = {state: [-1.0, -1.0] for state in STATES}
    values["decode"] = [-1.5, -2.0]
    values["definition"] = [-1.0, float("-inf")]
    found = attribute([_step(values, step=3)])
    assert all(link.tokens == 1 for link in found.links) and found.total.tokens == 1
    assert found.largest == "cache" and found.links[0].mean_abs == 0.5
    assert found.notes == [
        "1 tokens with a state that is not a finite number, left out of every link; the first at step 3, sample 0, "
        "response token 1 (id 5) in definition"
    ]


def test_a_links_mean_is_its_sum_over_its_tokens_and_a_link_of_no_token_has_mean_zero():
    values = {state: [-1.0, -1.0] for state in STATES}
    values["decode"] = [-1.25, -1.75]
    found = attribute([_step(values)])
    cache = found.links[0]
    assert (cache.tokens, cache.sum_abs, cache.mean_abs) == (2, 1.0, 0.5)
    step = _step({state: [-1.0] for state in STATES if state != "recorded"})
    assert attribute([step]).not_measured[0].mean_abs == 0.0


def test_ten_worst_tokens_by_default_the_largest_first_across_steps_each_named_whole():
    steps = []
    for k in range(3):
        values = {state: [-1.0] * 5 for state in STATES}
        values["decode"] = [-1.0 - (k * 5 + j) / 100 for j in range(5)]
        step = _step(values, step=k)
        step.where = torch.tensor([[7 + k, j, 100 + j] for j in range(5)])
        steps.append(step)
    found = attribute(steps)
    assert len(found.worst) == 10
    assert [(w.step, w.sample, w.response_token, w.token_id) for w in found.worst[:2]] == [
        (2, 9, 4, 104),
        (2, 9, 3, 103),
    ]
    assert found.worst[0].before == pytest.approx(-1.14, abs=1e-15) and found.worst[0].after == -1.0
    assert found.worst[0].delta == pytest.approx(0.14)


def test_the_worst_token_is_told_apart_in_float64_and_ties_keep_the_earlier_step():
    a, b, c = ({state: [-1.0] for state in STATES} for _ in range(3))
    a["decode"], b["decode"], c["decode"] = [-2.0], [-2.0 - 1e-12], [-2.0]
    found = attribute([_step(a, 0), _step(b, 1), _step(c, 2)], top=3)
    assert [w.step for w in found.worst] == [1, 0, 2]


def test_a_spans_reasons_are_those_of_the_states_inside_it_and_its_ends_only():
    values = _chain(-1.0, -1.5, -1.5, -1.5, -1.5, -1.5, -1.5, -1.5)
    step = _step(values, measured={"engine": [False]})
    step.reasons.update(engine="no engine to ask", dtype="a reason of a state after the span")
    found = attribute([step])
    assert found.links[0].names == ("cache", "kernels")
    assert found.links[0].reasons == ["engine: no engine to ask"]


def test_each_steps_row_gives_its_links_and_its_whole_mismatch_with_their_tokens():
    one = {state: [-1.0, -1.0] for state in STATES}
    one["decode"] = [-1.5, -1.25]
    two = {state: [-1.0] for state in STATES}
    found = attribute([_step(one, 4), _step(two, 5, measured={"recorded": [False]})])
    first, second = found.per_step
    assert first == {
        "step": 4,
        "tokens": 2,
        "links": {name: {"tokens": 2, "mean_abs": 0.375 if name == "cache" else 0.0} for name in LINK_NAMES},
        "total": {"tokens": 2, "mean_abs": 0.375},
    }
    assert second["total"] == {"tokens": 0, "mean_abs": 0.0} and "residual" not in second["links"]
    assert found.total.tokens == 2 and found.total.mean_abs == 0.375


def test_links_and_the_whole_sum_over_steps_and_an_unmeasured_end_counts_nowhere():
    one = {state: [-1.0, -1.0] for state in STATES}
    one["decode"] = [-1.5, -3.0]
    two = {state: [-1.0] for state in STATES}
    two["decode"] = [-1.25]
    found = attribute([_step(one, 0, measured={"decode": [True, False]}), _step(two, 1)])
    assert found.links[0].sum_abs == 0.75 and found.links[0].tokens == 2
    assert found.total.tokens == 2 and found.total.mean_abs == 0.375
    assert found.per_step[0]["total"] == {"tokens": 1, "mean_abs": 0.5}


def test_tokens_not_finite_are_counted_over_steps_and_per_step():
    rows = []
    for k in range(2):
        values = {state: [-1.0, -1.0] for state in STATES}
        values["engine"] = [float("nan"), -1.0]
        rows.append(_step(values, k))
    found = attribute(rows)
    assert [row["nonfinite"] for row in found.per_step] == [1, 1]
    assert (
        found.notes[0].startswith("2 tokens with a state that is not a finite number") and "in engine" in found.notes[0]
    )


def test_a_link_measured_nowhere_is_named_with_the_reasons_of_its_two_ends_only():
    values = {state: [-1.0] for state in STATES}
    step = _step(values, measured={"decode": [False]})
    step.reasons.update(decode="no engine log-prob recorded", forward="a reason past the link")
    found = attribute([step])
    (cache,) = found.not_measured
    assert (cache.names, cache.tokens, cache.sum_abs, cache.mean_abs) == (("cache",), 0, 0.0, 0.0)
    assert cache.reasons == ["decode: no engine log-prob recorded"]
    assert all(link.reasons == [] for link in found.links)  # a link measured alone carries no reason


def test_equal_deltas_keep_their_step_and_token_order_among_the_worst():
    one = {state: [-1.0] * 20 for state in STATES}
    one["decode"] = [-1.5] * 20
    found = attribute([_step(one, 0)], top=20)
    assert [w.response_token for w in found.worst] == list(range(20))
    two = {state: [-1.0] * 10 for state in STATES}
    two["decode"] = [-1.5] * 10
    found = attribute([_step(two, 0), _step(two, 1)], top=20)
    assert [(w.step, w.response_token) for w in found.worst] == [(s, t) for s in (0, 1) for t in range(10)]


def test_a_note_of_every_step_names_no_step_and_one_of_some_names_them():
    steps = [_step({state: [-1.0] for state in STATES}, k) for k in range(3)]
    for step in steps:
        step.same["forward"] = "forward = engine: one computation"
    steps[1].same["weights"] = "weights = dtype: the same weights"
    found = attribute(steps)
    notes = {link.name: link.notes for link in found.links}
    assert notes["kernels"] == ["forward = engine: one computation"]
    assert notes["weights"] == ["weights = dtype: the same weights (steps [1])"]
    assert found.total.names == ("total",) and found.total.name == "total"


def test_a_step_without_the_engines_decode_has_no_whole_mismatch():
    values = {state: [-1.0] for state in STATES if state != "decode"}
    found = attribute([_step(values)])
    assert found.total.tokens == 0 and "total" not in found.per_step[0]
    assert [link.name for link in found.not_measured] == ["cache"]


def test_the_servers_scores_are_read_as_slimes_on_policy_distillation_reads_them(server):
    """slime 624b824a slime/rollout/on_policy_distillation.py asks a server the same way (input_ids, max_new_tokens 0,
    return_logprob, logprob_start_len 0) and reads meta_info.input_token_logprobs[1:], the last response_length of
    them: the scorer (logprob_start_len one before the response) gives those values, bit for bit."""
    import urllib.request

    from rlbench.checks.attribution_http import ServerScorer
    from rlbench.checks.attribution_run import EngineNumerics
    from rlbench.config import load_config

    ids, prompt = torch.tensor([1, 275, 201, 273, 223, 24, 276, 277, 2, 24, 278, 2]), 8
    body = {
        "input_ids": ids.tolist(),
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    request = urllib.request.Request(
        server + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        entries = json.loads(answer.read())["meta_info"]["input_token_logprobs"]
    slimes = [entry[0] for entry in entries[1:]][-(len(ids) - prompt) :]
    scorer = ServerScorer(server, EngineNumerics.of(load_config()))
    held, values = scorer._one(ids, prompt)
    assert values[prompt:].tolist() == slimes and values[:prompt].abs().sum() == 0 and held


def test_a_checkpoint_whose_weights_are_damaged_is_refused_naming_the_file(run_small, tmp_path):
    run_small("damaged", steps=2, checkpoint_every=1)
    weights = tmp_path / "damaged" / "checkpoints" / "000001" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of the last tensor's values
    weights.write_bytes(bytes(data))
    done = cli("check", "logprobs", str(tmp_path / "damaged"), "--attribute")
    assert done.returncode == 2 and str(weights) in done.stderr and "do not match" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout


def test_the_prefix_plants_merged_attention_is_one_softmax_to_bfloat16s_rounding_with_other_bits():
    """batch_variant.merged_attention: the attention over the prompt's columns and the rest apart, each part rounded
    to bfloat16, merged by their log-sum-exp, equals one softmax over all of them to bfloat16's rounding (masked
    columns and a part with none visible weigh nothing), and its bits differ from one softmax's."""
    from rlbench.backends.batch_variant import merged_attention

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 1, 8, generator=generator)
    key, value = torch.randn(3, 2, 12, 8, generator=generator), torch.randn(3, 2, 12, 8, generator=generator)
    mask = torch.ones(3, 1, 1, 12, dtype=torch.bool)
    mask[0, ..., :3] = False  # row 0: its prompt left-padded by 3
    mask[1, ..., 5:] = False  # row 1: nothing visible after the prompt
    mask[1, ..., 11] = True
    mask[2, ..., :5] = False  # row 2: nothing visible in the prompt
    got, _ = merged_attention(None, query, key, value, mask, 0.35, prefix_columns=5)
    keys, values = key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1)
    weights = torch.softmax((query @ keys.transpose(-1, -2) * 0.35).masked_fill(~mask, float("-inf")), dim=-1)
    expected = (weights @ values).transpose(1, 2)
    assert got.shape == expected.shape == (3, 1, 4, 8)
    # each part a convex mix of values rounded once to bfloat16 (unit roundoff 2^-9), the mix's weights summing to 1
    bound = 2**-9 * value.abs().max() + 1e-6
    assert (got - expected).abs().max() <= bound and not torch.equal(got, expected)
    assert torch.isfinite(got).all()  # rows 1 and 2: a part that sees nothing weighs 0, not 0/0


@pytest.mark.parametrize(
    ("overrides", "field", "expected"),
    [
        ({"rollout__prefix_invariant": "no"}, "rollout.prefix_invariant", "true or false"),
        ({"rollout__batch_invariant": 0}, "rollout.batch_invariant", "true or false"),
        (
            {"rollout__prefix_invariant": False, "rollout__decode": "per-sample"},
            "rollout.decode",
            "batched where rollout.prefix_invariant is false",
        ),
        (
            {"rollout__prefix_invariant": False, "rollout__true_on_policy": True},
            "rollout.true_on_policy",
            "false where the engine's numerics differ",
        ),
        (
            {"rollout__batch_invariant": False, "rollout__true_on_policy": True},
            "rollout.true_on_policy",
            "false where the engine's numerics differ",
        ),
        (
            {"rollout__prefix_invariant": False, "rollout__backend": "sglang"},
            "rollout.backend",
            "hf where rollout.dtype, quantization, logprobs, batch_invariant or prefix_invariant",
        ),
    ],
)
def test_the_engines_planted_faults_are_refused_where_they_cannot_hold(overrides, field, expected):
    from rlbench.config import load_config

    with pytest.raises(BadInput) as refused:
        load_config(**overrides)
    assert refused.value.field == field and expected in str(refused.value)


def test_each_planted_fault_alone_is_accepted_on_the_embedded_batched_engine():
    from rlbench.config import load_config

    for overrides in ({"rollout__prefix_invariant": False}, {"rollout__batch_invariant": False}):
        assert load_config(**overrides).rollout.backend == "hf"
