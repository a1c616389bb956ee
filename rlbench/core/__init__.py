"""The loop's stages and what they read: backend protocols, seeding, data, rewards and the RL algorithm.

loop.py          one function per stage (rlbench/session.py calls them in order)
pipeline.py      async rollouts (slime v0.3's one-step and fully-async), deterministic by schedule
protocols.py     the backend interfaces: RolloutEngine, Trainer, RewardFn
context.py       Context, what the stages read (rlbench/session.py builds it), and check_made_with
types.py         the records between stages: Prompt, GenerateRequest, GenerateResult, Sample
samples.py       conversions between stages (engine results, samples, the trainer's batch)
seeding.py       derive_seed and the deterministic torch settings (CPU; GPU: --deterministic)
data.py          JSONL dataset validation, the seeded, resumable prompt cursor, prompt encoding
model.py         offline tokenizer and model loading, per-parameter seeded init
tensor_file.py   safetensors files made in one copy from where the tensors live
algo.py          GRPO advantages, PPO-clip loss, k1/k3 KL, entropy
lm_head.py       the LM head and log-softmax chunked together: a micro-batch's logits never whole
ppo.py           PPO with a critic (issue 56): GAE and returns, token whitening, the value loss
critic.py        PPO's critic (issue 56): the value model (the policy's decoder, a one-output head)
critic_stages.py PPO's stages in the loop: the critic's values, GAE's advantages and returns, the critic's step
reward.py        verifiers (parity, exact_match) and the --custom-rm-path contract
generate.py      the custom generate function contract (multi-turn, agentic): Trajectory, GenerateEnv
slime_contract.py  slime's plugin contract: its generate and reward functions loaded, checked, called as slime does
plugins.py       load a function by dotted path
metrics.py       step metrics under slime's names (train/*, rollout/*, perf/*)
trackers.py      each committed step's metrics also to W&B and TensorBoard (slime's --use-wandb, --use-tensorboard)
vocab.py         a run's valid token ids (the model's logits) and padded ids past the tokenizer
weight_check.py  the weight-update check: the engine holds the trainer's export, bit for bit
weight_delta.py  slime's delta weight sync: versions published and read, a chain checked
weight_pull.py   its engine's side, /pull_weights: a local checkpoint verified whole, then staged and renamed
confine.py       one path rule below a confining directory: resolved and held inside, written never through a link
"""
