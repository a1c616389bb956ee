"""The run directory's storage, used by the loop on every step and by every reader.

directory.py   the run directory: the step commit, checkpoints, validated reading
writes.py      atomic file writes, fsynced appends, the one ordered background writer
recording.py   a step's samples as flat safetensors tensors and per-sample JSON, self-verifying
digest.py      checksums of named tensors (name, dtype, shape, bytes), computed on their device: wordsum/1
digest_host.py its host side: the multiplier tables, host tensors' lanes summed over the CPU's threads
algorithm.py   the schema's and the checksum algorithm's names, and the refusal of a directory or recording
               that names another
manifest.py    a run's manifest (RUN/manifest.json): what made the run, laid out with the schema
sections.py    the manifest's sections held to their types when read back
lock.py        one writer per run directory: an OS lock on RUN/.lock
jsonio.py      reading JSON someone else wrote: every failure is BadInput naming the file
failpoints.py  named kill points in the write path, for the crash tests
"""
