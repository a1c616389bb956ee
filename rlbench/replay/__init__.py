"""Features built on the loop and the run directory: replay, diff, resume, slime import.

replay.py   replay a recording with no engine, verifying each stage; the train-only config
resume.py   cut a killed run back to its committed steps and continue it, or extend a finished one
export.py   a checkpoint as a Hugging Face model directory (config, tokenizer, weights) for from_pretrained
diff.py     the first differing (step, stage) and where inside it; tolerance mode
diff_layout.py  diff's advice where runs of different TP/DP layouts part by rounding: rerun both in float64
diff_extra.py  what diff compares beside the stages: sample weights versions; slime imports' schedules, fields
checkpoints.py  a run's checkpoints held to the checksums it recorded for them (diff, replay)
integrity.py  one integrity check of a run directory, for every command that reads one (open_run)
slime.py    import slime's debug rollout dumps, or a --dump-details directory (torch.load with weights_only=True)
slime_train.py  slime's train dumps (format 2) read field by field and joined to their rollout dumps
slime_joined.py  the joined train side as the recording's tensors (a PPO run's critic too), its critic-only steps
slime_train_v1.py  format 1 (a file per rank, slime before 2026-08 and Miles): TP, PP and CP ranks put together
slime_dir.py  a --dump-details directory: its parts, and Miles' sidecars
slime_sample.py  one sample of such a dump, field by field (used, kept or refused by name)
pickled.py  dumps loaded with weights_only=True; what a refused one's pickle names, from its opcodes, none run
"""
