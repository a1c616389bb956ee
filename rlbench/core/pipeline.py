"""Asynchronous rollouts as slime v0.3 runs them, deterministic by construction (issue 38).

slime generates ahead of training (train_async.py: rollout k+1 while rollout k trains; the fully-async worker: a
pool of groups across rollout boundaries, aborted groups requeued), so which weights generate a sample depends on
timing, and there is no staleness bound (slime #1800, #2278). Here the schedule decides everything before any
generation starts: which groups are generated in which window, with which weights version and which seeds. A
window is the time step r trains; the engine then holds version e(r) = I * (r // I), I the update interval
(`rollout.update_weights_interval`: slime syncs after step k when (k + 1) % I == 0, waiting first for the
generation in flight). A sample generated with version v and trained at step r has lag r - v.

- `one-step` (slime's train_async.py): step r + 1's groups are generated in window r; lags 1 .. I.
- `fully` with `max_staleness` K (slime's fully-async worker, bounded): groups are generated in window r as far
  ahead as K allows: the waiting groups train B a step (B = data.prompts_per_step), oldest weights first, then by
  group number, so each group's step is known when it is started, and it is started only if that step is within
  K versions of e(r). No group is older than K when its step comes: one started later carries the newest version,
  so it can pass only groups of that version and push them no further back than its own place, which K admitted;
  a group that leaves the queue moves the rest forward. A group with an aborted sample (only a slime plugin
  aborts one) is requeued and generated again once the weights have moved on, the plugin told its attempt.
  K = 0 generates nothing ahead: the on-policy run, bit for bit.

Groups are numbered over the run, g = step * B + slot, in the data cursor's order; the engine draws the seeds the
on-policy run gives (step, slot, index), a slime plugin its own (at each attempt, as slime's requeued groups do).
A step trains its groups in group order (slime sorts a batch by sample index). What a window generates runs on a
thread while the step trains; the step's sync waits for it, and an error there stops the run before the step
commits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from rlbench.core.loop import generate, group_request
from rlbench.core.types import GenerateRequest, Prompt, Sample
from rlbench.errors import BadInput

MODES = ("off", "one-step", "fully")
MAX_ATTEMPTS = 8  # a group aborted this many times stops the run (slime would requeue it for ever)


@dataclass
class Group:
    """One prompt's group of samples, from its first generation to the step that trains it."""

    gid: int  # run-wide group number: origin * B + slot
    origin: int  # the step whose prompts the data cursor drew it with
    slot: int  # its place among them
    prompt: Prompt
    attempt: int = 0
    version: int | None = None  # the weights version that generated it (this attempt)
    samples: list[Sample] = field(default_factory=list)
    aborted: list = field(default_factory=list)  # which samples aborted (a slime plugin's), if any

    def requeue_record(self, step: int, reason: str) -> dict:
        return {
            "group_id": self.gid,
            "origin_step": self.origin,
            "attempt": self.attempt,
            "weight_version": self.version,
            "step": step,
            "reason": reason,
        }


class Pipeline:
    """The groups between the data cursor and the steps that train them (module docstring)."""

    def __init__(self, ctx, steps: int):
        cfg = ctx.config.rollout
        self.ctx, self.steps, self.mode = ctx, steps, cfg.async_mode
        self.interval = cfg.update_weights_interval
        self.bound = cfg.max_staleness if self.mode == "fully" else self.interval
        self.per_step = ctx.config.data.prompts_per_step
        self.next_gid = 0
        self.requeued: list[Group] = []  # by group number
        self.ready: list[Group] = []  # generated, waiting for their step
        self.log: list[dict] = []  # requeues since the last step took its groups: recorded with it
        self.thread: threading.Thread | None = None
        self.window: list[Group] = []
        self.window_step = 0
        self.failure: BaseException | None = None

    def engine_version(self, step: int) -> int:
        """The weights version the engine holds while `step` trains."""
        return self.interval * (step // self.interval)

    # ---- a step's groups ----------------------------------------------------------------------------------------

    def take(self, step: int) -> tuple[list[Group], list[dict]]:
        """The groups step `step` trains (in group order, none with an aborted sample) and what is recorded with
        it (requeued and dropped groups): the window before joined, what is missing generated now with the
        engine's weights. Every group waiting is within the bound (the module docstring says why)."""
        self.wait()
        version = self.engine_version(step)
        generated = 0
        while len(self.ready) < self.per_step:
            batch = [self._next(version) for _ in range(self.per_step - len(self.ready))]
            generated += len(batch)
            if generated > self.per_step * MAX_ATTEMPTS:
                raise BadInput(
                    f"step {step}: {generated} groups generated for it, too few without an aborted sample",
                    field="rollout.async_mode",
                )
            self._generate(batch, version)
            self._settle(batch, step)
        self.ready.sort(key=lambda g: (g.version, g.gid))
        taken, self.ready = self.ready[: self.per_step], self.ready[self.per_step :]
        log, self.log = self.log, []
        # one-step, as on-policy: a group with an aborted sample takes its place in the step, untrained
        log += [g.requeue_record(step, "aborted: not trained") for g in taken if g.aborted]
        trained = sorted((g for g in taken if not g.aborted), key=lambda g: g.gid)
        if not trained:
            raise BadInput(
                f"step {step}: every group held an aborted sample ({len(taken)} groups): nothing to train",
                field="rollout.custom_generate_function_path",
            )
        return trained, log

    def samples(self, groups: list[Group], step: int) -> list[Sample]:
        """The step's samples, indexed by their place in it, each with the schedule's record of it."""
        out: list[Sample] = []
        for position, g in enumerate(groups):
            for s in g.samples:
                extra = dict(s.extra)
                if "group" in extra:  # a slime plugin's: its group in the step
                    extra["group"] = position
                extra["async"] = {
                    "group_id": g.gid,
                    "origin_step": g.origin,
                    "attempt": g.attempt,
                    "weight_version": g.version,
                    "lag": step - g.version,
                }
                out.append(replace(s, group_index=position, index=len(out), extra=extra))
        return out

    # ---- the window ahead -------------------------------------------------------------------------------------

    def start(self, step: int) -> None:
        """Generate ahead while `step` trains: the groups the bound admits, on a thread."""
        version = self.engine_version(step)
        admitted: list[Group] = []
        waiting = len(self.ready)
        while True:
            planned = step + 1 + (waiting + len(admitted)) // self.per_step
            if planned >= self.steps or planned - version > self.bound:
                break
            if self.mode == "one-step" and waiting + len(admitted) >= self.per_step:
                break
            admitted.append(self._next(version))
        if not admitted:
            return
        self.window, self.window_step = admitted, step
        self.thread = threading.Thread(target=self._run, args=(admitted, version, step), daemon=True)
        self.thread.start()

    def _run(self, groups: list[Group], version: int, step: int) -> None:
        try:
            self._generate(groups, version)
        except BaseException as exc:  # raised where the step waits for it
            self.failure = exc

    def wait(self) -> None:
        """Join the window's generation (the sync waits for it, as slime's does); its error is raised here."""
        if self.thread is None:
            return
        self.thread.join()
        self.thread = None
        groups, self.window = self.window, []
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure
        self._settle(groups, self.window_step)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    # ---- groups -------------------------------------------------------------------------------------------------

    def _next(self, version: int) -> Group:
        """The next group to generate: a requeued one whose weights have moved on, else the data cursor's next."""
        for g in self.requeued:
            if g.version < version:
                self.requeued.remove(g)
                g.attempt += 1
                if g.attempt >= MAX_ATTEMPTS:
                    raise BadInput(
                        f"group {g.gid} (step {g.origin}'s prompt {g.slot}) was aborted {g.attempt} times",
                        field="rollout.async_mode",
                    )
                g.samples, g.aborted = [], []
                return g
        gid = self.next_gid
        self.next_gid += 1
        origin, slot = divmod(gid, self.per_step)
        index = self.ctx.cursor.indices(origin)[slot]
        return Group(gid, origin, slot, self.ctx.dataset[index])

    def _requeue(self, g: Group, step: int, reason: str) -> None:
        self.log.append(g.requeue_record(step, reason))
        self.requeued.append(g)
        self.requeued.sort(key=lambda x: x.gid)

    def _settle(self, groups: list[Group], step: int) -> None:
        """Generated groups to their places: a group with an aborted sample requeued (fully), else ready."""
        for g in groups:
            if g.aborted and self.mode == "fully":
                self._requeue(g, step, "aborted")
            else:
                self.ready.append(g)

    def _generate(self, groups: list[Group], version: int) -> None:
        """Each group's samples, generated with the engine's weights (version `version`, as the schedule says)."""
        ctx = self.ctx
        held = getattr(ctx.engine, "weight_version", None)
        if held is not None and int(held) != version:
            raise RuntimeError(f"the engine holds weights version {held}, the schedule says {version}")
        for g in groups:
            g.version = version
        if ctx.plugin_rollout is not None:
            results = ctx.plugin_rollout.rollout_groups([(g.gid, g.prompt, g.attempt) for g in groups], ctx.prompt_ids)
            for g, (made, aborted) in zip(groups, results):
                g.samples, g.aborted = made, aborted
            return
        n = ctx.config.rollout.n_samples_per_prompt
        requests = [req for g in groups for req in self._requests(g)]
        made = generate(ctx, requests, [g.prompt for g in groups for _ in range(n)])
        for k, g in enumerate(groups):
            g.samples = made[k * n : (k + 1) * n]

    def _requests(self, g: Group) -> list[GenerateRequest]:
        """The group's engine requests, with the on-policy run's seeds (step, slot, index): only a slime plugin
        aborts a sample, so a group the engine generates is never requeued and has no later attempt."""
        prompt_ids = self.ctx.prompt_ids[g.prompt.index]
        n = self.ctx.config.rollout.n_samples_per_prompt
        return [group_request(self.ctx, prompt_ids, g.origin, g.slot, j) for j in range(n)]
