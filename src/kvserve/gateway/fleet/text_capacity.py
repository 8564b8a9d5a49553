"""Workers' KV capacity in the units of text keys, for a policy that forgets at capacity.

Text keys (no tokenizer in the gateway's keys) count a 256-character block as 64 tokens, 4
characters a token (`prefix.CHARS_PER_TOKEN`). Real traffic differs, and an index capped at the
assumed ratio forgets tenants its worker still caches. Where the workers' tokenizer is at hand (the
model directory a worker's /v1/models names, as for `precise`), a sample of the completion
prompts sent is tokenized to measure characters per token: every prompt until MIN_SAMPLES are
measured, then one in `every`. Every worker's capacity is given to the policy scaled by
measured / assumed characters per token: its capacity in the tokens text keys count. Without a
tokenizer the capacity passes unscaled.

The first prompts are all sampled because the index fills from the first requests: sampling
sparsely from the start would leave the assumed ratio in place while the index fills.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from kvserve.gateway.core.pipeline import CapacityAware
from kvserve.gateway.core.prefix import CHARS_PER_TOKEN

# Figures: `python -m benchmarks text-capacity` (docs/operations.md, constants).
DEFAULT_SAMPLE_EVERY = 32  # a 2-3k-token encode over 32 requests: 1-4 % of the proxy's CPU
MIN_SAMPLES = 4  # before the measured ratio replaces the assumed one: then within ~3 % (p90)
RESCALE_CHANGE = 0.02  # a measured ratio that moved this much re-tells the policy: above the
# converged ratio's noise (64 samples: at most 1.5 %), below the 4-sample error it corrects
MAX_SAMPLED_CHARS = 1 << 24  # the sums are halved past this: recent traffic weighs more


class TextCapacity:
    """Feeds `policy.set_worker_capacity` (call `worker_capacity` from the scraper's
    `on_capacity`, and `sample` with each text-keyed completion prompt). Used from the
    gateway's event loop only."""

    def __init__(self, policy: CapacityAware, every: int = DEFAULT_SAMPLE_EVERY) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.policy = policy
        self.every = every
        self.tokenizer: Tokenizer | None = None
        self.samples = 0
        self._seen = 0
        self._chars = 0
        self._tokens = 0
        self._applied = float(CHARS_PER_TOKEN)  # the ratio the policy's capacities use
        self._capacities: dict[str, int] = {}

    @property
    def chars_per_token(self) -> float:
        """Measured characters per token (the assumed 4 until enough samples)."""
        if self.samples < MIN_SAMPLES or self._tokens == 0:
            return float(CHARS_PER_TOKEN)
        return self._chars / self._tokens

    def worker_capacity(self, worker_id: str, kv_tokens: int) -> None:
        """The worker's KV cache holds `kv_tokens` tokens: tell the policy, scaled."""
        self._capacities[worker_id] = kv_tokens
        self._tell(worker_id, kv_tokens)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet: its capacity is no longer rescaled."""
        self._capacities.pop(worker_id, None)

    def sample(self, prompt: str) -> None:
        """A completion prompt sent with a text key: tokenize it if fewer than MIN_SAMPLES are
        measured, else one in `every`."""
        self._seen += 1
        if self.tokenizer is None or not prompt:
            return
        if self.samples >= MIN_SAMPLES and self._seen % self.every:
            return
        tokens = len(self.tokenizer.encode(prompt, add_special_tokens=False).ids)
        if tokens == 0:
            return
        self.samples += 1
        self._chars += len(prompt)
        self._tokens += tokens
        if self._chars > MAX_SAMPLED_CHARS:
            self._chars //= 2
            self._tokens = max(1, self._tokens // 2)
        ratio = self.chars_per_token
        if abs(ratio - self._applied) > RESCALE_CHANGE * self._applied:
            self._applied = ratio
            for worker_id, kv_tokens in self._capacities.items():
                self._tell(worker_id, kv_tokens)

    def _tell(self, worker_id: str, kv_tokens: int) -> None:
        scaled = round(kv_tokens * self._applied / CHARS_PER_TOKEN)
        self.policy.set_worker_capacity(worker_id, max(1, scaled))
