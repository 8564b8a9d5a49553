"""The model runner: one scheduled step in, one sampled token per finishing chunk out.

It implements the engine's `ModelExecutor`: flattens the step's tokens (prefill chunks and
decodes together), builds the attention metadata from the block tables the scheduler verified,
runs the network over the paged KV cache and samples the rows whose chunk reaches the end of its
sequence. With a host tier (and a disk tier), the step's copies between the tiers run first.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence

import torch

from kvserve.engine import Request, SampledToken, SchedulerOutput, TokenLogprob
from kvserve.model.attention_metadata import AttentionMetadata
from kvserve.model.host_kv import run_kv_transfers
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.lora.runner_hook import RunnerAdapters
from kvserve.model.paged_attention import KVCache
from kvserve.model.sampler import Sampler
from kvserve.model.step_plan import StepPlan


class ModelRunner:
    """Runs `model` over `kv_caches` (one per layer) for the engine, on the model's device.
    `host_kv_caches` and `disk_kv_caches` (one per layer, same block layout) back the host and
    disk tiers, if there are any."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: Sequence[KVCache],
        block_size: int,
        sampler: Sampler,
        host_kv_caches: Sequence[KVCache] = (),
        disk_kv_caches: Sequence[KVCache] = (),
    ) -> None:
        self.model = model
        self.kv_caches = list(kv_caches)
        self.host_kv_caches = list(host_kv_caches)
        self.disk_kv_caches = list(disk_kv_caches)
        self.block_size = block_size
        self.sampler = sampler
        self.device = next(model.parameters()).device
        self._prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]] = {}
        self.lora: RunnerAdapters | None = None  # LoRA adapters, when the engine serves them

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        # Invariant: row r of the flattened batch is token `start + j` of its sequence, and its
        # K/V lands in the slot its block table names for that position (see StepPlan).
        if output.kv_transfers:
            assert self.host_kv_caches, "copies to a host tier this runner does not have"
            assert self.disk_kv_caches or not (output.kv_transfers.demotions
                                               or output.kv_transfers.disk_loads), "no disk tier"
            run_kv_transfers(output.kv_transfers, self.kv_caches, self.host_kv_caches,
                             self.disk_kv_caches)
        self._prompt_logprobs = {}
        if not output.scheduled:
            return {}
        plan = StepPlan.from_output(output, self.block_size, step_id=0, with_checksum=False)
        if self.lora is not None:
            self.lora.begin_step(output.scheduled, plan.query_start)
        try:
            hidden = self.forward(plan)  # [num_tokens, hidden]
        finally:
            if self.lora is not None:
                self.lora.end_step()
        self._prompt_logprobs = self.score_prompts(output, plan.query_start, hidden)
        requests = [item.request for item in output.scheduled if item.sample]
        return self.sample(hidden, plan, requests)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run the network over `plan` (writing its K/V) -> hidden [num_tokens, hidden]."""
        device = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(plan.query_start, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(plan.seq_lens, dtype=torch.int32, device=device),
            block_tables=_padded_tables(plan.block_tables, device),
            slot_mapping=torch.tensor(plan.slot_mapping, dtype=torch.int64, device=device),
            query_start_cpu=plan.query_start,
            seq_lens_cpu=plan.seq_lens,
            block_tables_cpu=plan.block_tables,
        )
        tokens = torch.tensor(plan.input_ids, dtype=torch.long, device=device)  # [num_tokens]
        pos = torch.tensor(plan.positions, dtype=torch.long, device=device)  # [num_tokens]
        hidden: torch.Tensor = self.model(tokens, pos, self.kv_caches, meta)
        return hidden

    @torch.inference_mode()
    def sample(self, hidden: torch.Tensor, plan: StepPlan,
               requests: Sequence[Request]) -> dict[str, SampledToken]:
        """Logits of `plan.sample_rows` of hidden [num_tokens, hidden], one token per request
        (`requests` in the same order)."""
        if not plan.sample_rows:
            return {}
        rows = torch.tensor(plan.sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [num_samples, vocab]
        sampled = self.sampler.sample(logits, requests)
        return {r.request_id: s for r, s in zip(requests, sampled, strict=True)}

    def release(self, request_ids: Iterable[str]) -> None:
        self.sampler.release(list(request_ids))

    def take_prompt_logprobs(self) -> dict[str, list[tuple[int, TokenLogprob]]]:
        """The last step's prompt logprobs (see `ModelExecutor.take_prompt_logprobs`)."""
        found, self._prompt_logprobs = self._prompt_logprobs, {}
        return found

    def score_prompts(self, output: SchedulerOutput, query_start: Sequence[int],
                       hidden: torch.Tensor) -> dict[str, list[tuple[int, TokenLogprob]]]:
        """Logprobs of the prompt tokens that this step's chunks predict, for the requests
        asking for them: the row at position p predicts prompt token p + 1."""
        found: dict[str, list[tuple[int, TokenLogprob]]] = {}
        for i, item in enumerate(output.scheduled):
            request = item.request
            k = request.sampling_params.prompt_logprobs
            end = min(item.start + item.num_new_tokens, request.num_prompt_tokens - 1)
            if k is None or item.start >= end:
                continue
            rows = hidden[query_start[i] : query_start[i] + end - item.start]  # [rows, hidden]
            logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            targets = request.prompt_token_ids[item.start + 1 : end + 1]
            chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
            ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()  # [rows]
            top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
            entries = []
            for row, (position, token_id) in enumerate(zip(range(item.start + 1, end + 1),
                                                           targets, strict=True)):
                top: tuple[tuple[int, float], ...] = ()
                if top_ids is not None and top_values is not None:
                    top = tuple(zip(top_ids[row].tolist(), top_values[row].tolist(),
                                    strict=True))
                entries.append((position, TokenLogprob(token_id, float(chosen[row, 0]), top,
                                                       ranks[row])))
            found[request.request_id] = entries
        return found


def _padded_tables(tables: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one [num_seqs, max_len] int32 tensor, rows padded with block 0.
    Filled through a C array, which is cheaper than building the tensor from nested lists."""
    width = max(len(t) for t in tables)
    flat = array.array("i", bytes(4 * width * len(tables)))  # zeros
    for i, table in enumerate(tables):
        flat[i * width : i * width + len(table)] = array.array("i", table)
    return torch.frombuffer(flat, dtype=torch.int32).view(len(tables), width).to(device)
