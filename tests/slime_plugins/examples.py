"""slime plugins of rlbench's own writing, in the shapes of slime's examples, talking to the engine over SGLang's
HTTP API through slime's http_utils (Miles' where slime is not installed), as slime users write them:

- single_turn: slime's default generate (slime/rollout/sglang_rollout.py `generate`, text prompts only).
- resend_text: search-r1's shape (examples/search-r1): every turn sends the conversation so far as *text*, so the
  engine re-tokenises ids it sampled, and trains on ids it never saw as the prompt: `check tito` must flag it.
- append_tokens: retool's shape (examples/retool): every turn sends the sample's own ids, tool output appended as
  ids with loss mask 0: `check tito` must pass it, tool spans unjudged.
- multi_agent: a fan-out (examples/multi_agent): two agents' samples from one prompt, sharing `rollout_id`.
- sets_reward, aborts_some: a generate function that scores its own trajectory; one that aborts some samples.
- no_logprobs, returns_text: wrong on purpose (trainable tokens without log-probs; not a Sample).
- reward, group_reward: a reward of one sample, and slime's batched `--group-rm` one.
"""

from __future__ import annotations

import copy
import re

try:  # slime where it is installed, else Miles (its fork, with the same contract)
    from slime.utils.http_utils import post
except ImportError:
    from miles.utils.http_utils import post

_TOKENIZERS: dict = {}
FINISH = {"stop": "COMPLETED", "length": "TRUNCATED", "abort": "ABORTED"}


def tokenizer(args):
    """slime's GenerateState loads the tokenizer from args.hf_checkpoint; so does this."""
    if args.hf_checkpoint not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[args.hf_checkpoint] = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    return _TOKENIZERS[args.hf_checkpoint]


def url(args) -> str:
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"


def tool(text: str) -> str:
    """A tool the model 'calls': the parity of its answer's length, as an observation."""
    return f"\n<result>{'even' if len(text) % 2 == 0 else 'odd'}</result>\n"


def _sampled(output: dict) -> tuple[list[int], list[float], str]:
    pairs = output["meta_info"]["output_token_logprobs"]
    return [p[1] for p in pairs], [p[0] for p in pairs], output["meta_info"]["finish_reason"]["type"]


def _finish(sample, prompt_ids, response, ids, mask, logprobs, finish):
    sample.tokens = prompt_ids + ids
    sample.response = response
    sample.response_length = len(ids)
    sample.loss_mask = mask
    sample.rollout_log_probs = logprobs
    sample.status = getattr(type(sample).Status, FINISH[finish])
    return sample


async def single_turn(args, sample, sampling_params):
    prompt_ids = tokenizer(args).encode(sample.prompt, add_special_tokens=False)
    output = await post(
        url(args), {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True}
    )
    ids, logprobs, finish = _sampled(output)
    return _finish(sample, prompt_ids, output["text"], ids, [1] * len(ids), logprobs, finish)


async def _two_turns(args, sample, sampling_params, as_text: bool):
    tok = tokenizer(args)
    prompt_ids = tok.encode(sample.prompt, add_special_tokens=False)
    response, ids, mask, logprobs, finish = "", [], [], [], "stop"
    for turn in range(2):
        payload = {"sampling_params": dict(sampling_params), "return_logprob": True}
        if as_text:
            payload["text"] = sample.prompt + response
        else:
            payload["input_ids"] = prompt_ids + ids
        output = await post(url(args), payload)
        got, got_logprobs, finish = _sampled(output)
        response += output["text"]
        ids, mask, logprobs = ids + got, mask + [1] * len(got), logprobs + got_logprobs
        if turn == 1:
            break
        observation = tool(output["text"])
        observed = tok.encode(observation, add_special_tokens=False)
        response += observation
        ids, mask, logprobs = ids + observed, mask + [0] * len(observed), logprobs + [0.0] * len(observed)
    return _finish(sample, prompt_ids, response, ids, mask, logprobs, finish)


async def resend_text(args, sample, sampling_params):
    return await _two_turns(args, sample, sampling_params, as_text=True)


async def append_tokens(args, sample, sampling_params):
    return await _two_turns(args, sample, sampling_params, as_text=False)


async def multi_agent(args, sample, sampling_params):
    """A solver and a critic from one prompt (the critic with its own seed): two samples of one rollout."""
    solver = await single_turn(args, copy.deepcopy(sample), sampling_params)
    critic_params = {**sampling_params, "sampling_seed": sampling_params.get("sampling_seed", 0) + 1000}
    critic = await single_turn(args, copy.deepcopy(sample), critic_params)
    for s in (solver, critic):
        if hasattr(s, "rollout_id"):
            s.rollout_id = sample.index
    return [solver, critic]


async def sets_reward(args, sample, sampling_params):
    sample = await single_turn(args, sample, sampling_params)
    sample.reward = float(len(sample.response) % 3) / 2
    return sample


async def aborts_some(args, sample, sampling_params):
    sample = await single_turn(args, sample, sampling_params)
    if sample.index % 8 == 3:
        sample.status = type(sample).Status.ABORTED
    return sample


async def no_logprobs(args, sample, sampling_params):
    sample = await single_turn(args, sample, sampling_params)
    sample.rollout_log_probs = None
    return sample


async def returns_text(args, sample, sampling_params):
    return (await single_turn(args, sample, sampling_params)).response


def _parity(sample) -> float:
    """rlbench's built-in parity verifier's rule: the first 'even' or 'odd' in the response is the label."""
    found = re.search(r"even|odd", sample.response, re.IGNORECASE)
    return 1.0 if found and found.group(0).lower() == str(sample.label).lower() else 0.0


async def reward(args, sample):
    if isinstance(sample, list):  # slime's batched call for a fan-out's samples
        return [_parity(s) for s in sample]
    return _parity(sample)


async def group_reward(args, samples):
    return [_parity(s) + 0.5 * (i == 0) for i, s in enumerate(samples)]


async def raises(args, sample, sampling_params):
    raise ValueError("the tool server is down")
