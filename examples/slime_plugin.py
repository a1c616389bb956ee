"""A slime rollout plugin as slime users write them (slime's contract: THUDM/slime
docs/en/get_started/customization.md), runnable under `rlbench run` unchanged: a two-turn generate function that
sends the engine the sample's own token ids every turn and appends a tool's output as ids with loss mask 0 (the
shape of slime's retool example), and a reward function.

    PYTHONPATH=.vendor/miles-rl-0.0.2 rlbench run --custom-generate-function-path examples.slime_plugin.generate \
        --custom-rm-path examples.slime_plugin.reward

It needs slime's `Sample` and `http_utils`: slime installed from its source, or Miles' `miles/` package on the
path, as above from the repository's root (`python tests/get_miles.py`, in the README's set-up, unpacks it into
.vendor/miles-rl-0.0.2 without installing Miles' wheel). docs/usage.md, "Your slime plugins".
"""

from __future__ import annotations

import re

try:
    from slime.utils.http_utils import post
except ImportError:  # Miles, slime's fork, has the same contract
    from miles.utils.http_utils import post

_TOKENIZERS: dict = {}


def _tokenizer(args):
    if args.hf_checkpoint not in _TOKENIZERS:  # slime's GenerateState loads it from the same place
        from transformers import AutoTokenizer

        _TOKENIZERS[args.hf_checkpoint] = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    return _TOKENIZERS[args.hf_checkpoint]


async def generate(args, sample, sampling_params):
    tok = _tokenizer(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = tok.encode(sample.prompt, add_special_tokens=False)
    response, ids, mask, logprobs, finish = "", [], [], [], "stop"
    for turn in range(2):
        payload = {"input_ids": prompt_ids + ids, "sampling_params": dict(sampling_params), "return_logprob": True}
        output = await post(url, payload)
        sampled = output["meta_info"]["output_token_logprobs"]  # [log-prob, id, text] per sampled token
        finish = output["meta_info"]["finish_reason"]["type"]
        response += output["text"]
        ids += [t[1] for t in sampled]
        logprobs += [t[0] for t in sampled]
        mask += [1] * len(sampled)
        if turn == 0:  # the tool's answer: context for the next turn, not trained
            observation = f"\n<result>{len(output['text']) % 2}</result>\n"
            observed = tok.encode(observation, add_special_tokens=False)
            response += observation
            ids += observed
            logprobs += [0.0] * len(observed)
            mask += [0] * len(observed)
    sample.tokens = prompt_ids + ids
    sample.response, sample.response_length = response, len(ids)
    sample.loss_mask, sample.rollout_log_probs = mask, logprobs
    sample.status = type(sample).Status.TRUNCATED if finish == "length" else type(sample).Status.COMPLETED
    return sample


async def reward(args, sample):
    """1.0 when the first 'even' or 'odd' in the response is the label."""
    found = re.search(r"even|odd", sample.response, re.IGNORECASE)
    return 1.0 if found and found.group(0).lower() == str(sample.label).lower() else 0.0
