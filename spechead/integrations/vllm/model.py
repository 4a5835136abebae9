"""An EAGLE-3 drafter for vLLM whose draft head is one of spechead's heads.

vLLM's own ``Eagle3LlamaForCausalLM`` runs the backbone (its attention, its paged KV cache, its kernels); this
subclass replaces only the head. vLLM asks the drafter for a draft token in one of two ways:

- ``get_top_tokens(h)`` (with ``use_local_argmax_reduction``): the head's top-1 target id per row, straight from
  spechead's ``DraftHead.topk``: a subset head multiplies only its N rows and maps indices back through its id
  list; a low-rank head reads r(d + V) weights. No [B, V] row is ever written.
- ``compute_logits(h)`` (vLLM's default, and for sampled drafts): [B, V] logits, -inf where the head cannot
  propose: the full-width scatter vLLM's ``d2t`` path does, kept only for that fallback.

Which head: the ``spechead`` block of the drafter's config.json (``{"head": "lowrank"}``, ``"fr:token_list.pt"``,
...), written by ``spechead export --format vllm``. A low-rank head's factors are the checkpoint's
``lm_head.down.weight`` / ``lm_head.up.weight`` (config ``lm_head_rank``) in spechead's ``LowRankLinear``; a head
over the full matrix reads the checkpoint's ``lm_head.weight`` or, for a drafter tied to the target, the
target's head, which vLLM shares in after loading (so the head is built on its first call).

NanoSpec (``{"head": "nanospec..."}``) keeps its active vocabulary from what the drafter's ``forward`` sees: the
token ids vLLM feeds it (the prompt at prefill, then each round's verified tokens with the bonus token, then its
own drafts). A forward that is one prompt alone (positions 0..n-1) starts a new set, which at batch 1 is the
paper's per-request set; any other forward adds its ids to one set shared by the batch (vLLM's hooks carry no
request identity), least recently hit ids evicted at ``W_max``. Not reachable in vLLM: the target's top-3 over
the prompt and its top-k at the drafted nodes (a proposer never sees the target's logits).

``has_own_lm_head`` is set only when the checkpoint holds a head: otherwise vLLM's proposer swaps in the
target's ``lm_head``, which is what a tied drafter wants; the spechead head is then built over it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

from spechead.heads import DraftHead, make_head
from spechead.heads.nanospec import NanoSpecHead
from spechead.integrations.vllm.export import CONFIG_KEY
from spechead.model.lowrank import LowRankLinear

NANOSPEC_DEFAULTS = {"policy": "lru", "gather": "sync"}
HEAD_CALLS: dict[str, int] = {}  # head spec -> draft calls in this process (the integration test reads it)


class SpecheadEagle3ForCausalLM(Eagle3LlamaForCausalLM):
    """vLLM's EAGLE-3 backbone with a spechead draft head."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cfg = self.config
        opts = dict(getattr(cfg, CONFIG_KEY, None) or {})
        self.head_spec: str = opts.get("head", "full")
        self.folder = Path(vllm_config.speculative_config.draft_model_config.model)
        self.target_vocab = vllm_config.model_config.get_vocab_size()
        self.has_own_lm_head = False  # until load_weights finds a head in the checkpoint
        rank = getattr(cfg, "lm_head_rank", None)
        if rank:  # SlimSpec factors: spechead's module, not a [V, d] ParallelLMHead that would never be read
            self.lm_head = LowRankLinear(cfg.hidden_size, cfg.draft_vocab_size, int(rank))
        self._head: DraftHead | None = None
        self.head_calls = 0
        self.sets_started = 0  # NanoSpec: sets begun at a lone prompt (the integration test reads it)

    # -- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        factors: dict[str, Tensor] = {}

        def backbone() -> Iterable[tuple[str, Tensor]]:
            for name, w in weights:
                if name.startswith("lm_head.") and isinstance(self.lm_head, LowRankLinear):
                    factors[name.removeprefix("lm_head.")] = w
                else:
                    yield name, w

        super().load_weights(backbone())  # sets has_own_lm_head when the checkpoint has lm_head.weight
        if factors:
            state = self.lm_head.state_dict()
            if set(factors) != set(state):
                raise ValueError(f"low-rank head needs {sorted(state)}, checkpoint has {sorted(factors)}")
            self.lm_head.load_state_dict({k: v.to(state[k].dtype) for k, v in factors.items()})
            self.has_own_lm_head = True

    # -- the head ------------------------------------------------------------------------------
    def spechead_head(self) -> DraftHead:
        """spechead's head over this drafter's LM head, built on first use: a tied drafter's head is the
        target's, which vLLM shares in only after ``load_weights``."""
        if self._head is None:
            with torch.no_grad():
                self._head = self._build_head()
        return self._head

    def _build_head(self) -> DraftHead:
        name, _, arg = self.head_spec.partition(":")
        if arg and not arg.lstrip("-").isdigit() and not Path(arg).is_absolute() and (self.folder / arg).is_file():
            arg = str(self.folder / arg)  # a token list shipped in the exported folder
        if name == "nanospec":  # one set for the whole batch: it must evict, and update at the draft call
            defaults = [f"{k}={v}" for k, v in NANOSPEC_DEFAULTS.items() if f"{k}=" not in arg]
            arg = ":".join(([arg] if arg else []) + defaults)
        spec = f"{name}:{arg}" if arg else name
        row_ids = None
        if self.draft_id_to_target_id is not None:
            row_ids = self.draft_id_to_target_id + torch.arange(self.config.draft_vocab_size, device=self._device())
        if isinstance(self.lm_head, LowRankLinear):
            lr = self.lm_head.requires_grad_(False)
            return make_head(spec, lr.dense(), row_ids, self.target_vocab, lr)
        weight = self.lm_head.weight.detach()[: self.config.draft_vocab_size]  # vLLM pads the vocabulary
        return make_head(spec, weight, row_ids, self.target_vocab)

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def _count(self) -> None:
        self.head_calls += 1
        HEAD_CALLS[self.head_spec] = HEAD_CALLS.get(self.head_spec, 0) + 1

    def forward(
        self, input_ids: Tensor, positions: Tensor, hidden_states: Tensor, inputs_embeds: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        if input_ids is not None and self.head_spec.startswith("nanospec"):
            self._observe_ids(input_ids, positions)
        return super().forward(input_ids, positions, hidden_states, inputs_embeds)

    def _observe_ids(self, input_ids: Tensor, positions: Tensor) -> None:
        """NanoSpec's context as vLLM shows it: a lone prompt (positions 0..n-1) starts a new set, any other
        forward's ids join the set (see the module docstring)."""
        head = self.spechead_head()
        assert isinstance(head, NanoSpecHead)
        n = positions.numel()
        if n and int(positions[0]) == 0 and int(positions[-1]) == n - 1:
            head.begin(input_ids, None)
            self.sets_started += 1
        else:
            head.extend(input_ids)

    def get_top_tokens(self, hidden_states: Tensor) -> Tensor:
        """The head's top-1 target id per row [B] (greedy drafts with ``use_local_argmax_reduction``)."""
        self._count()
        return self.spechead_head().topk(hidden_states, 1)[1][:, 0]

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """[B, V] logits over the target vocabulary, -inf outside what the head can propose (vLLM's default
        path and sampled drafts; greedy drafts should go through ``get_top_tokens``)."""
        self._count()
        return self.spechead_head().reference_logits(hidden_states).to(hidden_states.dtype)


def head_module(model: nn.Module) -> SpecheadEagle3ForCausalLM | None:
    """The spechead drafter inside a (possibly wrapped) vLLM draft model, or None."""
    for m in model.modules():
        if isinstance(m, SpecheadEagle3ForCausalLM):
            return m
    return None
