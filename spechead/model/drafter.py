"""EAGLE-1/2 and EAGLE-3 drafters, loading and saving the published checkpoint layouts.

EAGLE-1/2 (``cnets1`` layout): ``fc`` over [token embedding, target feature] (2d -> d), one decoder
layer without input norm, no final norm; logits come from the *target's* LM head applied to the
layer output. EAGLE-3 (``cnets`` layout): ``fc`` over three fused target layers (3d -> d), a
``midlayer`` whose attention reads [input_layernorm(embedding), hidden_norm(h)] (2d), its own
``norm`` and ``lm_head``, and optionally a reduced draft vocabulary mapped to target ids by ``d2t``.
An EAGLE-3 drafter may instead carry a SlimSpec low-rank head (config ``lm_head_rank``, tensors
``lm_head.down.weight`` [r, d] and ``lm_head.up.weight`` [V, r], TorchSpec's layout).

Both share the target's token embedding (never trained, never needed in the checkpoint). The
published checkpoints are ``config.json`` + ``pytorch_model.bin``; we write ``model.safetensors``
and read either. Tensor names and shapes follow the published layouts exactly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from spechead import kernels
from spechead.errors import SpecheadError
from spechead.kernels.linear import prepack_linears
from spechead.kernels.qlinear import QuantLinear, QuantWeight, quantize_linears
from spechead.model.config import ModelConfig
from spechead.model.layers import (
    Block,
    KVCache,
    Linear,
    RMSNorm,
    Rotary,
    Segment,
    as_segments,
    fused_args,
    fused_stack,
    is_prefill,
)
from spechead.model.loading import read_safetensors, read_safetensors_file
from spechead.model.lowrank import LowRankLinear
from spechead.model.transformer import TargetOutput, Transformer


class Drafter(nn.Module):
    """Common machinery: own KV cache and RoPE, shared target embedding, checkpoint I/O."""

    arch = ""

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding) -> None:
        super().__init__()
        self.config = cfg
        self._embed = [embed]  # a list, so the target's table is neither registered nor saved
        self.rotary: Rotary | None = None
        self.max_len, self.lanes = 0, 0
        self._fused: tuple | None = None  # decoder_layers' weight arguments for the layer, built at first use

    @property
    def embed(self) -> nn.Embedding:
        return self._embed[0]

    @property
    def layer(self) -> Block:
        raise NotImplementedError

    @property
    def float_weight(self) -> Tensor:
        """A float parameter of the backbone (its norm): the dtype and device its states take, at every precision."""
        return self.layer.post_attention_layernorm.weight

    def setup_cache(self, max_len: int, lanes: int = 1) -> None:
        """A cache of ``lanes`` sequences (one per request decoded at once) of up to ``max_len`` slots."""
        cfg, p = self.config, self.float_weight
        if max_len <= self.max_len and lanes <= self.lanes:  # only grows: decoders with other trees share one drafter
            return
        self.max_len, self.lanes = max(max_len, self.max_len), max(lanes, self.lanes)
        self.rotary = Rotary(cfg.head_dim, self.max_len, cfg.rope_theta, cfg.rope_scaling).to(p.device)
        kv = KVCache(self.max_len, cfg.num_key_value_heads, cfg.head_dim, p.dtype, p.device, self.lanes)
        self.layer.self_attn.cache = kv
        self._fused = None

    def prepack(self, precision: str = "fp32") -> bool:
        """Inference: the backbone's projections on the few-row kernel, as the target's (``Transformer.prepack``):
        a drafter pass runs every round at a few rows, where sgemm costs about twice the kernel's time. Beside a
        target on the integer engine (``precision`` gguf, q8 or q4) they are fused (q/k/v, gate/up) and quantized
        to q8 instead (the drafter's precision changes what it proposes, never the output), and the drafter no
        longer trains. At fp32 the parameters and the state dict stay as they are, so a laid-out drafter still
        trains and saves; its own LM head (EAGLE-3) is the draft head's to lay out, not this."""
        self._fused = None
        if precision in ("gguf", "q8", "q4"):
            if hasattr(self.layer.self_attn, "q_proj"):  # one q/k/v and one gate/up product, as the target's
                self.layer.self_attn.fuse()
                self.layer.mlp.fuse()
            quantize_linears(self, "q8", skip=("lm_head",))
            return True
        return prepack_linears(self, skip=("lm_head",))

    # -- what each architecture defines -------------------------------------------------------
    def target_features(self, out: TargetOutput) -> Tensor:
        """The target states this drafter consumes, one row per target position."""
        raise NotImplementedError

    def forward(
        self, tokens: Tensor, feats: Tensor, start: int | Sequence[Segment], positions: Tensor, mask: Tensor | None
    ) -> Tensor:
        """Pairs (feature_j, token_{j+1}) at drafter slots [start, start+T) -> predicted next features. ``start``
        may instead be the segments of several requests' rows (``layers.Segment``; ``mask`` is then None)."""
        raise NotImplementedError

    def head_input(self, h: Tensor) -> Tensor:
        """The vector the LM head multiplies (EAGLE-3 applies its final norm)."""
        return h

    def head_weight(self, target: Transformer) -> tuple[Tensor, Tensor | None]:
        """(weight [V_draft, d], target ids of its rows or None for the identity)."""
        raise NotImplementedError

    # -- checkpoint I/O ----------------------------------------------------------------------
    def draft_config(self) -> dict[str, Any]:
        return dict(self.config.extra)

    def checkpoint_state(self) -> dict[str, Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.endswith("inv_freq")}

    def save(self, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        state = {
            k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
            for k, v in self.checkpoint_state().items()
        }
        cfg = self.draft_config()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return out


def draft_config_from_target(target_cfg: ModelConfig, **overrides: Any) -> dict[str, Any]:
    """A one-layer draft config.json in the published layout, sized like the target."""
    t = target_cfg
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "num_hidden_layers": 1,
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta,
        "vocab_size": t.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": t.extra.get("bos_token_id"),
        "eos_token_id": t.extra.get("eos_token_id"),
    }
    d.update(overrides)
    return d


LOW_RANK_FILE = "lowrank_head.safetensors"  # an EAGLE-2 drafter's fitted low-rank head: proj [d, r], down [r, d]


@dataclass
class FittedHead:
    """A fitted low-rank head as stored (``proj``, ``down``) and the target head ``up = head @ proj`` comes from."""

    target_head: Tensor
    proj: Tensor
    down: Tensor
    _module: nn.Module | None = None

    def module(self):
        if self._module is None:
            self._module = LowRankLinear.from_projection(self.target_head, self.proj, self.down)
        return self._module


class Eagle2Drafter(Drafter):
    """EAGLE-1/2: logits from the target's own head. It may carry a low-rank head beside it (``LOW_RANK_FILE``,
    see ``model.lowrank.whitened_factors``): ``up = target head @ proj`` is recomputed at load, so its twin with
    the full head is the very same drafter."""

    arch = "eagle2"

    side_low_rank = True  # its low-rank head is one more head beside the target's, not its own head

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding) -> None:
        super().__init__(cfg, embed)
        d = cfg.hidden_size
        self.fc = Linear(2 * d, d, bias=bool(cfg.extra.get("bias", True)))
        self.layers = nn.ModuleList([Block(cfg, input_norm=False)])
        self._fitted: FittedHead | None = None  # not a submodule: not in the state dict, not moved by .to()

    @property
    def low_rank_head(self):
        """The fitted low-rank head (a ``LowRankLinear`` over the target's vocabulary, built on first use: it
        is V x r, 84 MB at Gemma's 262,144 x 80 in fp32), or None."""
        return self._fitted.module() if self._fitted is not None else None

    def attach_low_rank_head(self, target_head: Tensor, proj: Tensor, down: Tensor) -> None:
        self._fitted = FittedHead(target_head, proj.cpu(), down.cpu())

    def detach_low_rank_head(self) -> None:
        """Forget the fitted head (it was fitted to these weights; training changes them)."""
        self._fitted = None

    def write_low_rank_head(self, out: Path) -> None:
        """fp32, two [d, r] matrices: the up-projection is recomputed from them at load."""
        f = self._fitted
        save_file({"proj": f.proj.float().contiguous(), "down": f.down.float().contiguous()}, out / LOW_RANK_FILE)

    def save(self, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        out = super().save(out, dtype)
        if self._fitted is not None:
            self.write_low_rank_head(out)
        elif (out / LOW_RANK_FILE).is_file():  # fitted to other weights: it must not outlive them
            (out / LOW_RANK_FILE).unlink()
        return out

    @property
    def layer(self) -> Block:
        return self.layers[0]

    def run_layer(
        self, x: Tensor, start: int | Sequence[Segment], mask: Tensor | None, rope: tuple[Tensor, Tensor]
    ) -> Tensor | None:
        """The layer over ``x`` (its attention reads ``x`` as it is: no input norm) as the kernels' one-op
        ``decoder_layers`` where it runs (a fused drafter on the kernel, a few rows a request): what
        ``layer(x, x, ...)`` computes, bitwise; None where it does not run."""
        if self._fused is None:
            self._fused = fused_stack([self.layer], self.config, [False])
        args = fused_args([self.layer], self._fused, x, as_segments(start, x.shape[0], mask), rope)
        return None if args is None else kernels.ops().decoder_layers(x, *args, [])[-1]

    def target_features(self, out: TargetOutput) -> Tensor:
        return out.hidden

    def forward(
        self, tokens: Tensor, feats: Tensor, start: int | Sequence[Segment], positions: Tensor, mask: Tensor | None
    ) -> Tensor:
        prefill = is_prefill(start)
        x = self.fc(torch.cat([self.embed(tokens), feats.to(self.float_weight.dtype)], dim=-1), prefill)
        cos, sin = self.rotary(positions)
        fused = self.run_layer(x, start, mask, (cos, sin))
        return fused if fused is not None else self.layer(x, x, cos, sin, start, mask, prefill=prefill)

    def head_weight(self, target: Transformer) -> tuple[Tensor | QuantWeight, Tensor | None]:
        """The target's LM head: its float weight, or a quantized target's blocks (the head's default precision)."""
        head = target.lm_head
        return (head.layout if isinstance(head, QuantLinear) else head.weight), None


class Eagle3Drafter(Drafter):
    arch = "eagle3"

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding, lm_head: Tensor | None = None) -> None:
        super().__init__(cfg, embed)
        d = cfg.hidden_size
        target_d = cfg.extra.get("target_hidden_size", d)
        self.draft_vocab_size = cfg.extra.get("draft_vocab_size", cfg.vocab_size)
        self.fc = Linear(3 * target_d, d, bias=False)
        self.midlayer = Block(cfg, attn_in=2 * d, input_norm=True)
        self.midlayer.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        # A head tied to the target's is not stored (it is the target's own tensor).
        rank = cfg.extra.get("lm_head_rank")
        self.tied_head = lm_head is not None and not rank
        if self.tied_head:
            self._tied = [lm_head]
        elif rank:
            self.lm_head = LowRankLinear(d, self.draft_vocab_size, int(rank))
        else:
            self.lm_head = nn.Linear(d, self.draft_vocab_size, bias=False)
        if self.draft_vocab_size != cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    @property
    def layer(self) -> Block:
        return self.midlayer

    def target_features(self, out: TargetOutput) -> Tensor:
        if out.aux is None:
            raise RuntimeError("EAGLE-3 needs the target's fused layer states (want_aux=True)")
        return out.aux

    def forward(
        self, tokens: Tensor, feats: Tensor, start: int | Sequence[Segment], positions: Tensor, mask: Tensor | None
    ) -> Tensor:
        prefill = is_prefill(start)
        h = feats.to(self.float_weight.dtype)
        if h.shape[-1] != self.config.hidden_size:  # target features are fused; recycled ones are not
            h = self.fc(h, prefill)
        layer = self.midlayer
        attn_in = torch.cat([layer.input_layernorm(self.embed(tokens)), layer.hidden_norm(h)], dim=-1)
        cos, sin = self.rotary(positions)
        return layer(h, attn_in, cos, sin, start, mask, prefill=prefill)

    def head_input(self, h: Tensor) -> Tensor:
        return self.norm(h)

    @property
    def low_rank_head(self):
        """The trained ``LowRankLinear`` head, or None for a full head."""
        return None if self.tied_head or isinstance(self.lm_head, nn.Linear) else self.lm_head

    def head_weight(self, target: Transformer) -> tuple[Tensor, Tensor | None]:
        """For a low-rank head this is the dense product (exact same logits; ``Session.decoder`` uses the factors)."""
        lr = self.low_rank_head
        w = self._tied[0] if self.tied_head else lr.dense() if lr is not None else self.lm_head.weight
        if self.draft_vocab_size == self.config.vocab_size:
            return w, None
        return w, self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)

    def draft_config(self) -> dict[str, Any]:
        cfg = super().draft_config()
        cfg["tie_lm_head_to_target"] = self.tied_head
        if self.low_rank_head is not None:
            cfg["lm_head_rank"] = self.low_rank_head.rank
        else:
            cfg.pop("lm_head_rank", None)
        return cfg

    def set_draft_vocab(self, token_ids: Tensor) -> None:
        """Install a reduced vocabulary: ``token_ids`` (sorted ascending) become draft indices."""
        ids = token_ids.sort().values
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True


ARCHS: dict[str, type[Drafter]] = {"eagle2": Eagle2Drafter, "eagle3": Eagle3Drafter}


def detect_arch(state: dict[str, Tensor]) -> str:
    if any(k.startswith("midlayer.") for k in state):
        return "eagle3"
    if any(k.startswith("layers.0.") for k in state):
        return "eagle2"
    raise SpecheadError("checkpoint is neither an EAGLE-1/2 (layers.0.*) nor an EAGLE-3 (midlayer.*) drafter")


def check_compatible(cfg: ModelConfig, target_cfg: ModelConfig, arch: str) -> None:
    """Refuse a drafter built for another target: vocabulary and hidden sizes must match."""
    if cfg.vocab_size != target_cfg.vocab_size:
        raise SpecheadError(
            f"drafter vocabulary ({cfg.vocab_size}) does not match the target's ({target_cfg.vocab_size})"
        )
    target_d = cfg.extra.get("target_hidden_size", cfg.hidden_size) if arch == "eagle3" else cfg.hidden_size
    if target_d != target_cfg.hidden_size or (arch == "eagle2" and cfg.hidden_size != target_cfg.hidden_size):
        raise SpecheadError(f"drafter hidden size ({target_d}) does not match the target's ({target_cfg.hidden_size})")


def build_drafter(arch: str, cfg_dict: dict[str, Any], target: Transformer) -> Drafter:
    cfg = ModelConfig.from_hf(cfg_dict)
    check_compatible(cfg, target.config, arch)
    embed = target.model.embed_tokens
    if arch == "eagle3":
        tied = cfg_dict.get("tie_lm_head_to_target", False)
        rank = cfg_dict.get("lm_head_rank")
        if rank is not None and (not isinstance(rank, int) or not 0 < rank < cfg.hidden_size):
            raise SpecheadError(f"drafter lm_head_rank must be an integer in [1, {cfg.hidden_size - 1}], got {rank!r}")
        return Eagle3Drafter(cfg, embed, target.lm_head.weight if tied else None)
    if arch not in ARCHS:
        raise SpecheadError(f"unknown drafter architecture {arch!r}; expected one of {sorted(ARCHS)}")
    return ARCHS[arch](cfg, embed)


def random_drafter(target: Transformer, arch: str = "eagle2", seed: int = 0, **cfg_overrides: Any) -> Drafter:
    """A seeded, randomly initialised drafter sized for ``target`` (useful before any training)."""
    overrides = {"bias": False} if arch == "eagle2" else {"draft_vocab_size": target.config.vocab_size}
    overrides.update(cfg_overrides)
    cfg = draft_config_from_target(target.config, **overrides)
    gen = torch.Generator().manual_seed(seed)
    p = target.model.norm.weight  # the target's float dtype and device, at every precision
    drafter = build_drafter(arch, cfg, target)
    with torch.no_grad():
        for name, t in drafter.named_parameters():
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
    return drafter.to(device=p.device, dtype=p.dtype).eval()


def load_drafter(path: str | Path, target: Transformer) -> Drafter:
    """Load a drafter folder (config.json + model.safetensors or pytorch_model.bin)."""
    folder = Path(path)
    if not folder.is_dir():
        raise SpecheadError(f"drafter not found: {path}")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise SpecheadError(f"no config.json in drafter folder {folder}")
    try:
        cfg_dict = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise SpecheadError(f"invalid drafter config {cfg_path}: {e}") from e
    weight_files = [f for f in folder.glob("*.safetensors") if f.name != LOW_RANK_FILE]
    if (folder / "pytorch_model.bin").is_file() and not weight_files:
        try:
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            raise SpecheadError(f"corrupt drafter weights {folder / 'pytorch_model.bin'}: {e}") from e
    else:
        state = read_safetensors(folder, exclude=(LOW_RANK_FILE,))
    arch = detect_arch(state)
    try:
        drafter = build_drafter(arch, cfg_dict, target)
    except KeyError as e:
        raise SpecheadError(f"drafter config {cfg_path} lacks key {e}") from e
    state = {k: v for k, v in state.items() if k != "embed_tokens.weight" and not k.endswith("inv_freq")}
    expected = drafter.checkpoint_state()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise SpecheadError(
            f"drafter {folder} does not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise SpecheadError(f"drafter tensor {k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}")
    drafter.load_state_dict(state, strict=False)
    p = target.model.norm.weight  # the target's float dtype and device, at every precision
    drafter = drafter.to(device=p.device, dtype=p.dtype).eval()
    if (folder / LOW_RANK_FILE).is_file():
        if not isinstance(drafter, Eagle2Drafter):
            raise SpecheadError(f"{folder / LOW_RANK_FILE}: a fitted low-rank head belongs to an EAGLE-2 drafter")
        factors = read_safetensors_file(folder / LOW_RANK_FILE)
        if set(factors) != {"proj", "down"}:
            raise SpecheadError(f"{folder / LOW_RANK_FILE} must hold exactly 'proj' and 'down', got {sorted(factors)}")
        drafter.attach_low_rank_head(target.lm_head.weight, factors["proj"], factors["down"])
    return drafter
