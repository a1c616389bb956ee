"""The `engine` state of `check logprobs --attribute --engine-url URL`: a user's SGLang server (or router, or
`rlbench serve`) scores each sample through SGLang's native API, alone and with no cache.

- POST /flush_cache once before the first request (SGLang answers it once nothing runs; a reused prefix would
  otherwise be the cache's values, not a forward's).
- One POST /generate per sample: {"input_ids": prompt + response, "sampling_params": {"max_new_tokens": 0,
  "temperature": T, "top_p", "top_k"}, "return_logprob": true, "logprob_start_len": prompt - 1}. The answer's
  meta_info.input_token_logprobs holds one [logprob, id, text] per input position from logprob_start_len on, the
  first one's logprob null (SGLang scores no prefix it was not given): position p's log-prob is entry p - start.
  Each entry's id is held to the sample's token there.
- The weight version: each answer's meta_info.weight_version against the version the sample was drawn with
  (`weight_version` in the recording, as rlbench pushed it: str(v)). A sample whose server answers another version
  is not measured, and the reason says which the server holds. With `load_weights`, each version the steps sampled
  with is first loaded into the server from the run's checkpoints (an ordinary Hugging Face directory written to a
  temporary folder the server must be able to read; POST /update_weights_from_disk {"model_path",
  "weight_version"}, then /flush_cache): the server is left holding the last version loaded.

The key a server asks for (SGLang's --api-key) comes from RLBENCH_SGLANG_API_KEY, as a run's client's does (keys.py):
never an option, never printed.
"""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import torch

from rlbench.errors import BadInput


class ServerScorer:
    def __init__(self, url: str, numerics, load_weights=None, timeout: float = 600.0):
        from rlbench.keys import client_api_key
        from rlbench.validate import normalize_url

        self.url = normalize_url(url, "--engine-url")
        self.numerics = numerics
        self.key = client_api_key()
        self.timeout = timeout
        self.load_weights = load_weights  # None, or (weights of version v, config.json path): loads each version
        self.flushed = False
        self.loaded: int | None = None
        self.folder: tempfile.TemporaryDirectory | None = None

    def _call(self, path: str, body: dict | None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST")
        request.add_header("Content-Type", "application/json")
        if self.key:
            request.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise BadInput(f"{self.url}{path} answered {exc.code}: {detail}", field="--engine-url") from None
        except (urllib.error.URLError, OSError) as exc:
            raise BadInput(f"{self.url}{path}: no answer ({exc})", field="--engine-url") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text  # /flush_cache answers text

    def _flush(self) -> None:
        self._call("/flush_cache", None)
        self.flushed = True

    def _load(self, version: int) -> None:
        from rlbench.core.weight_delta import write_hf_directory

        weights, config_json = self.load_weights
        if self.folder is None:
            self.folder = tempfile.TemporaryDirectory(prefix="rlbench-attribute-")
        path = write_hf_directory(Path(self.folder.name) / f"weight_v{version:06d}", weights(version), config_json)
        answer = self._call("/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)})
        if not (isinstance(answer, dict) and answer.get("success")):
            raise BadInput(f"{self.url} did not load weight version {version}: {answer!r}", field="--engine-url")
        self.loaded = version
        self._flush()

    def score(self, ids: list[torch.Tensor], prompts: list[int], rows: list[int], versions: list[int], out):
        """Per sample (judged ones; None elsewhere) its full-length log-probs as the server reads them (0 over the
        prompt), where the server held the sample's weight version; the reasons for the others in `out`."""
        if not self.flushed:
            self._flush()
        scored: list[torch.Tensor | None] = [None] * len(ids)
        other: set[str] = set()
        for i in sorted(rows, key=lambda i: versions[i]):
            if self.load_weights is not None and self.loaded != versions[i]:
                self._load(versions[i])
            held, values = self._one(ids[i], prompts[i])
            if held != str(versions[i]):
                other.add(held)
                continue
            scored[i] = values
        if other:
            out.reasons["engine"] = (
                f"the server answered with weight version {', '.join(map(repr, sorted(other)))}, not the one the "
                "samples were drawn with (--engine-load-weights loads it)"
            )
        return scored

    def _one(self, ids: torch.Tensor, prompt: int) -> tuple[str, torch.Tensor]:
        start = max(prompt - 1, 0)
        numerics = self.numerics
        answer = self._call(
            "/generate",
            {
                "input_ids": ids.tolist(),
                "sampling_params": {
                    "max_new_tokens": 0,
                    "temperature": numerics.temperature,
                    "top_p": numerics.top_p,
                    "top_k": numerics.top_k,
                },
                "return_logprob": True,
                "logprob_start_len": start,
            },
        )
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(entries, list) or len(entries) != len(ids) - start:
            raise BadInput(
                f"{self.url}/generate: expected meta_info.input_token_logprobs with {len(ids) - start} entries "
                f"(logprob_start_len {start} of {len(ids)} input ids), got {str(entries)[:120]}",
                field="--engine-url",
            )
        values = torch.zeros(len(ids), dtype=torch.float64)
        for p in range(max(prompt, 1), len(ids)):
            entry = entries[p - start]
            if not (isinstance(entry, list) and len(entry) >= 2 and entry[1] == int(ids[p])):
                raise BadInput(
                    f"{self.url}/generate: input_token_logprobs[{p - start}] is {entry!r}, expected [logprob, "
                    f"{int(ids[p])}, ...]",
                    field="--engine-url",
                )
            if not isinstance(entry[0], (int, float)):
                raise BadInput(
                    f"{self.url}/generate: input_token_logprobs[{p - start}] has no log-prob ({entry[0]!r})",
                    field="--engine-url",
                )
            values[p] = float(entry[0])
        return str(meta.get("weight_version")), values

    def held_weights(self, expected: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor] | None, list[str], str]:
        """What the server holds, told against `expected` (the engine's copy of the version it reports): SGLang's
        /weights_checker hashes each tensor (sha256 of its bytes on the CPU, wire.tensor_hash); a tensor whose hash
        differs is fetched whole (/get_weights_by_name). (its weights, the names that differ, "") where the server's
        hashes can be compared; (None, [], why not) where they cannot (no /weights_checker, weights sharded over
        ranks, its own fused names)."""
        from rlbench.backends.sglang import wire

        try:
            answer = self._call("/weights_checker", {"action": "checksum"})
            got = wire.parse_checksums(answer, f"{self.url}/weights_checker")
        except (BadInput, ValueError) as exc:
            return None, [], f"its weights cannot be checked ({exc})"
        if got.ranks > 1 or set(got.checksums) != set(expected):
            return None, [], "its weights cannot be checked (sharded over ranks, or named as its own layout)"
        differ = [name for name, tensor in expected.items() if got.checksums[name] != wire.tensor_hash(tensor)]
        held = dict(expected)
        for name in differ:
            values = self._call("/get_weights_by_name", {"name": name, "truncate_size": 2**31 - 1})
            try:
                held[name] = torch.tensor(values, dtype=torch.float32).to(expected[name].dtype)
            except (TypeError, ValueError, RuntimeError):
                raise BadInput(
                    f"{self.url}/get_weights_by_name {name}: expected the tensor's values, got {str(values)[:80]}",
                    field="--engine-url",
                ) from None
            if held[name].shape != expected[name].shape:
                raise BadInput(
                    f"{self.url}/get_weights_by_name {name}: shape {tuple(held[name].shape)}, the model's "
                    f"{tuple(expected[name].shape)}",
                    field="--engine-url",
                )
        return held, differ, ""

    def close(self) -> None:
        if self.folder is not None:
            self.folder.cleanup()
