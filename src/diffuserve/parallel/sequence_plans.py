"""Which DiTs sequence parallel knows and how to split each (their token counts, attention processors and
argument layouts), and the start-up check that refuses a model or degree it cannot split. Read by
`parallel/sequence.py`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffuserve.errors import ConfigError

if TYPE_CHECKING:
    from diffuserve.pipelines.base import Pipeline

# -- the state of one sharded transformer call -------------------------------------------------------------


# -- the per-DiT plans ------------------------------------------------------------------------------------


def image_tokens(transformer: Any, args: dict[str, Any]) -> int:
    return int(args["hidden_states"].shape[1])


def video_tokens(transformer: Any, args: dict[str, Any]) -> int:
    shape = args["hidden_states"].shape[2:]
    return math.prod(int(n) // int(p) for n, p in zip(shape, transformer.config.patch_size, strict=True))


def patched_video_tokens(transformer: Any, args: dict[str, Any]) -> int:
    """Video tokens of a DiT whose config has an int `patch_size` and a `patch_size_t` (HunyuanVideo 1.5)."""
    frames, height, width = (int(n) for n in args["hidden_states"].shape[2:])
    config = transformer.config
    return (frames // int(config.patch_size_t)) * (height // int(config.patch_size)) * (width // int(config.patch_size))


@dataclass(frozen=True)
class DitPlan:
    """Where one DiT class's image tokens are split and gathered."""

    module: str
    """The diffusers module whose attention processors call `dispatch_attention_fn` (wrapped once)."""
    tokens: Callable[[Any, dict[str, Any]], int]
    """Image tokens of a call, from the transformer and its forward arguments (by name)."""
    inputs: tuple[tuple[str, str, int, int], ...]
    """(submodule path, argument, split dim, required ndim): arguments split on entry ("" = the transformer)."""
    outputs: tuple[tuple[str, tuple[int, ...], int], ...] = ()
    """(submodule path, output indices, split dim): positional tables split where they are made."""
    attention: tuple[tuple[str, str], ...] = ()
    """(block list, attribute): the joint self-attention modules (cross-attention runs locally unchanged)."""
    gather: str = "proj_out"
    """The submodule whose output (batch, local tokens, channels) is gathered back to every token."""
    gathered_keys: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    """(block list, attribute, keyword arguments): attention modules whose keys/values are the split tokens while
    their queries are replicated (LTX-2's video-to-audio cross-attention): those arguments (the split tokens and
    their key RoPE) are all-gathered on entry, so every rank attends to every token."""


_PLANS: dict[str, DitPlan] = {
    "FluxTransformer2DModel": DitPlan(
        module="diffusers.models.transformers.transformer_flux",
        tokens=image_tokens,
        inputs=(("", "hidden_states", 1, 3), ("", "img_ids", 0, 2)),
        attention=(("transformer_blocks", "attn"), ("single_transformer_blocks", "attn")),
    ),
    "QwenImageTransformer2DModel": DitPlan(
        module="diffusers.models.transformers.transformer_qwenimage",
        tokens=image_tokens,
        inputs=(("", "hidden_states", 1, 3),),
        outputs=(("pos_embed", (0,), 0),),  # (image freqs, text freqs): the text keeps all of its own
        attention=(("transformer_blocks", "attn"),),
    ),
    "WanTransformer3DModel": DitPlan(
        module="diffusers.models.transformers.transformer_wan",
        tokens=video_tokens,
        # Wan makes its tokens inside forward (patch embedding): split them where block 0 receives them, and
        # TI2V-5B's per-token timesteps (batch, tokens) on entry.
        inputs=(("", "timestep", 1, 2), ("blocks.0", "hidden_states", 1, 3)),
        outputs=(("rope", (0, 1), 1),),
        attention=(("blocks", "attn1"),),
    ),
    "HunyuanVideo15Transformer3DModel": DitPlan(
        module="diffusers.models.transformers.transformer_hunyuan_video15",
        tokens=patched_video_tokens,
        # Tokens are made inside forward (patch embedding): split where block 0 receives them, with the RoPE
        # tables (cos, sin: tokens x dim). The native adapter's processor lays the joint sequence out as
        # [text, video] with a key-padding mask (families/hunyuan_video15/adapter.py), as the split reads it.
        inputs=(("transformer_blocks.0", "hidden_states", 1, 3),),
        outputs=(("rope", (0, 1), 0),),
        attention=(("transformer_blocks", "attn"),),
    ),
    "LTX2VideoTransformer3DModel": DitPlan(
        module="diffusers.models.transformers.transformer_ltx2",
        tokens=image_tokens,  # the video arrives packed (batch, tokens, channels)
        # The video tokens, their position ids (batch, 3, tokens, 2; the RoPE tables follow) and an image-to-video
        # per-token timestep (batch, tokens). The audio tokens are replicated: a short sequence (about 25 per
        # second of clip against thousands of video tokens) that every video token reads in the audio-to-video
        # cross-attention, so splitting it would add a gather per block to save little.
        inputs=(("", "hidden_states", 1, 3), ("", "video_coords", 2, 4), ("", "timestep", 1, 2)),
        attention=(("transformer_blocks", "attn1"),),
        # The video-to-audio cross-attention reads every video token from the (replicated) audio queries.
        gathered_keys=(("transformer_blocks", "video_to_audio_attn", ("encoder_hidden_states", "key_rotary_emb")),),
    ),
}


def plan_of(module: Any) -> Any:
    """The split plan of a DiT, looked up along its class's bases: FSDP2 wraps a sharded module in a dynamic
    subclass (`FSDPFluxTransformer2DModel`), whose base is the model class the plan is for."""
    for cls in type(module).__mro__:
        if cls.__name__ in _PLANS:
            return _PLANS[cls.__name__]
    return None


def degree_flag(ulysses_degree: int, ring_degree: int) -> str:
    return "ulysses_degree" if ulysses_degree > 1 else "ring_degree"


def check_sequence_parallel(pipeline: Pipeline, *, ulysses_degree: int, ring_degree: int) -> None:
    """Refuse (ConfigError naming the flag) a pipeline or degree the sequence split cannot run."""
    from diffuserve.family_spec import families_with, named_list, spec_for

    if ulysses_degree < 1 or ring_degree < 1:
        raise ConfigError(
            f"--ulysses-degree ({ulysses_degree}) and --ring-degree ({ring_degree}) must be >= 1.",
            param=degree_flag(ulysses_degree, ring_degree),
        )
    if ulysses_degree * ring_degree == 1:
        return
    flag = degree_flag(ulysses_degree, ring_degree)
    family = pipeline.family
    if not pipeline.split_over_ranks:  # only the native recipe's loop splits over ranks
        raise ConfigError(
            f"--{flag.replace('_', '-')}: the {family} model runs on the diffusers backend, which has "
            f"no sequence split here; serve it with --backend native "
            f"({named_list(families_with('sequence_parallel'))}) or drop --ulysses-degree/--ring-degree.",
            param=flag,
        )
    try:
        supported = spec_for(family).profile.sequence_parallel
    except KeyError:  # an unknown family name: no spec, so no split
        supported = False
    keys = [k for k in pipeline.denoisers if k in pipeline.components]
    plans = {k: plan_of(pipeline.components[k]) for k in keys}
    if not supported or not keys or None in plans.values():
        split = families_with("sequence_parallel")
        raise ConfigError(
            f"--{flag.replace('_', '-')}: the {family} family has no sequence split (families with "
            f"one: {', '.join(split)}); drop --ulysses-degree/--ring-degree (replicas with --dp-size "
            "use several GPUs with any model).",
            param=flag,
        )
    for key in keys:
        config = pipeline.components[key].config
        heads = int(config.num_attention_heads)
        if heads % ulysses_degree:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ConfigError(
                f"--ulysses-degree {ulysses_degree} does not divide the {heads} attention heads of "
                f"{key}; use one of {divisors} and put the rest of the ranks in --ring-degree "
                "(any degree works for Ring).",
                param="ulysses_degree",
            )
        if getattr(config, "zero_cond_t", False):
            raise ConfigError(
                f"--{flag.replace('_', '-')}: {key} uses per-token modulation (zero_cond_t), which the "
                "sequence split does not shard; drop --ulysses-degree/--ring-degree for this model.",
                param=flag,
            )
