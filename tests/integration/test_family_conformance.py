"""The family conformance suite: every generic check, run for each `FamilyCase` (family_conformance.py) that
says it applies. Tolerances are documented there.

Tests are grouped per case (the module-scoped `case` fixture), so each family's pipeline, diffusers reference and
one real server are shared by its checks and the server stops before the next family's starts. Family facts that
fit no generic check live in `test_family_<family>.py`; the few that need the family's server are at the end here.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import openai
import pytest

from diffuserve.config.model_profiles import group_of
from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
from diffuserve.errors import InvalidRequestError
from diffuserve.pipelines.recipe import RecipePipeline
from diffuserve.runtime.layerwise import default_layer_specs
from diffuserve.runtime.ledger import TransferLedger
from diffuserve.runtime.residency import build_residency
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import (
    assert_rebuild_identical,
    layered_components,
    max_pixel_diff,
    simulate_steps,
)
from tests.integration.family_conformance import BLUE_WIDE, BY_ID, QWEN_EDIT, RED, FamilyCase, ids
from tests.integration.family_references import Subject, outputs_of, png, resident_run
from tests.integration.helpers import decode_b64_png, metric_value
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.timeout(300)


def cases(check) -> Any:
    """Parametrize `case` (indirectly, by id) over the cases `check(case)` selects."""
    return pytest.mark.parametrize("case", ids(check), indirect=True)


@pytest.fixture(scope="module")
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return BY_ID[request.param]


@pytest.fixture(scope="module")
def path(case: FamilyCase, tiny_checkpoint, request: pytest.FixtureRequest) -> Path:
    # FLUX.1's test model is the session's `tiny_flux_path` (built once for every FLUX.1 test).
    return request.getfixturevalue("tiny_flux_path") if case.tiny == "flux" else tiny_checkpoint(case.tiny)


@pytest.fixture(scope="module")
def native(path: Path, family_pipeline) -> Any:
    return family_pipeline(path)


@pytest.fixture(scope="module")
def subject(native, path: Path, diffusers_pipeline) -> Subject:
    return Subject(native, path, diffusers_pipeline)


def params_of(case: FamilyCase, native: Any, fields: dict[str, Any]) -> SamplingParams:
    return case.build_params(native, fields)


# -- what the checkpoint is ---------------------------------------------------------------------------------


@cases(lambda c: True)
def test_loads_as_its_family(case: FamilyCase, native) -> None:
    subject = native.adapter if isinstance(native, RecipePipeline) else native  # the backend serves its own
    assert (type(subject).__name__, native.family) == (case.pipeline_class, case.family)
    assert native.output_kind == case.output
    assert bool(native.supports_continuous) is case.continuous
    if case.size_multiple is not None:
        assert native.size_multiple == case.size_multiple


@cases(lambda c: c.rebuild)
def test_tiny_rebuild_is_byte_identical_and_small(case: FamilyCase, path: Path, tmp_path: Path) -> None:
    assert_rebuild_identical(case.tiny, path, tmp_path, max_bytes=case.max_bytes)


# -- native == diffusers --------------------------------------------------------------------------------------


def _reference_cases() -> list:
    return [
        pytest.param(c.id, name, id=f"{c.id}-{name}")
        for c in BY_ID.values()
        if c.reference
        for name, _ in c.reference_params
    ]


@pytest.mark.parametrize(("case", "variant"), _reference_cases(), indirect=["case"])
def test_native_matches_diffusers(case: FamilyCase, native, subject: Subject, variant: str) -> None:
    params = params_of(case, native, dict(case.reference_params)[variant])
    native.validate(params)
    (ours,) = resident_run(native, [params])
    theirs = case.reference(subject, params)
    assert len(ours) == len(theirs) == params.n
    if case.output == "image":
        for a, b in zip(ours, theirs, strict=True):
            assert a.size == b.size and a.mode == b.mode
            if case.sized_as_requested:
                assert a.size == (params.width, params.height)
    if params.n > 1:
        assert max_pixel_diff(ours[:1], ours[1:2]) > 0  # row j is its own draw (seed + j), not a copy of row 0
    assert max_pixel_diff(ours, theirs) <= case.reference_tolerance


FLOW_SHIFT = 2.5
"""A request's `flow_shift` in the check below (every tiny checkpoint's own shift differs from it)."""


@cases(lambda c: c.reference is not None and c.output == "image" and c.pipeline_class != "DiffusersBackendPipeline")
def test_flow_shift_equals_diffusers_with_that_static_shift(case: FamilyCase, native, subject: Subject) -> None:
    """A request's `flow_shift` (the peer field of SGLang-Diffusion / vLLM-Omni / FastVideo) runs what diffusers runs
    when its pipeline's scheduler has that static shift (dynamic shifting off); a family whose scheduler has no
    shift does not take the field."""
    from diffuserve.pipelines.batch_rows import has_flow_shift, scheduler_template

    if not has_flow_shift(native.adapter.scheduler):
        assert "flow_shift" not in native.request_fields()
        return
    assert "flow_shift" in native.request_fields()
    # Three steps: with two, a schedule stretched to a terminal sigma (Qwen-Image 2.1) is [1, end] whatever the shift.
    fields = {**case.reference_params[0][1], "num_inference_steps": 3}
    params = params_of(case, native, {**fields, "flow_shift": FLOW_SHIFT})
    ours = outputs_of(native, native.run([params]).outputs[0])
    swapped: list[tuple[Any, Any]] = []

    def shifted_diffusers(class_name: str, path: Path) -> Any:
        pipe = subject.diffusers(class_name, path)
        swapped.append((pipe, pipe.scheduler))
        pipe.scheduler = scheduler_template(pipe.scheduler, FLOW_SHIFT)
        return pipe

    original = native.adapter.scheduler
    native.adapter.scheduler = scheduler_template(original, FLOW_SHIFT)  # references built on native's modules read it
    try:
        theirs = case.reference(Subject(native, subject.path, shifted_diffusers), params)
    finally:
        native.adapter.scheduler = original
        for pipe, scheduler in swapped:
            pipe.scheduler = scheduler
    assert max_pixel_diff(ours, theirs) <= case.reference_tolerance
    unshifted = outputs_of(native, native.run([params_of(case, native, fields)]).outputs[0])
    assert max_pixel_diff(ours, unshifted) > 0, "flow_shift did not reach the schedule"


# -- batching ---------------------------------------------------------------------------------------------------


def _merge_cases() -> list:
    return [pytest.param(c.id, k, id=f"{c.id}-{k}") for c in BY_ID.values() for k in range(len(c.merge_batches))]


@pytest.mark.parametrize(("case", "batch_index"), _merge_cases(), indirect=["case"])
def test_merged_rows_equal_their_singletons(case: FamilyCase, native, batch_index: int) -> None:
    batch = [params_of(case, native, fields) for fields in case.merge_batches[batch_index]]
    if case.token_ratio is not None and case.count_tokens is not None:
        tokens = [case.count_tokens(native, p.prompt) for p in batch[:2]]
        assert tokens[1] > case.token_ratio * tokens[0], tokens
    merged = [outputs_of(native, out) for out in native.run(batch).outputs]
    assert [len(m) for m in merged] == [p.n for p in batch]
    for params, got in zip(batch, merged, strict=True):
        assert max_pixel_diff(got, outputs_of(native, native.run([params]).outputs[0])) <= case.merge_tolerance
    if case.merged_rows_differ:  # the prompts and seeds reach the output
        assert max_pixel_diff(merged[0][:1], merged[1][:1]) > 8


def _packed_cases() -> list:
    return [pytest.param(c.id, k, id=f"{c.id}-{k}") for c in BY_ID.values() for k in range(len(c.packed_batches))]


@pytest.mark.parametrize(("case", "batch_index"), _packed_cases(), indirect=["case"])
def test_packed_rows_equal_their_singletons(case: FamilyCase, native, batch_index: int) -> None:
    """Rows of different sizes and text lengths in ONE denoiser call per step equal their requests run alone."""
    batch = [params_of(case, native, fields) for fields in case.packed_batches[batch_index]]
    assert native.describe_model().packs_mixed_sizes
    assert len({(p.width, p.height) for p in batch}) > 1
    calls: list[int] = []
    denoiser = native.adapter.component(native.denoisers[0])
    hook = denoiser.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        packed = [outputs_of(native, out) for out in native.run(batch).outputs]
    finally:
        hook.remove()
    steps, branches = batch[0].num_inference_steps, 2 if native.uses_cfg(batch[0]) and not native.batched_cfg else 1
    assert len(calls) == steps * branches, (len(calls), steps, branches)
    for params, got in zip(batch, packed, strict=True):
        assert [im.size for im in got] == [(params.width, params.height)] * params.n
        assert max_pixel_diff(got, outputs_of(native, native.run([params]).outputs[0])) <= case.merge_tolerance


@cases(lambda c: bool(c.packed_batches) and not c.family.startswith("flux2"))  # tiny FLUX.2: one block, no cache
def test_packed_step_cache_rows_equal_their_singletons(case: FamilyCase, native) -> None:
    """Per-row step caches on packed rows: taylorseer with a refresh interval per request, so rows that compute
    share calls with rows that forecast (the narrowing cuts the packed rows' tables and masks with them, and each
    row caches its real tokens only); each request equals its run alone, decisions and outputs."""
    from diffuserve.config.step_cache import StepCacheSettings

    fields = case.packed_batches[0]
    batch = [
        dataclasses.replace(
            params_of(case, native, {**f, "num_inference_steps": 4}),
            step_cache=StepCacheSettings(method="taylorseer", warmup_steps=1, refresh_interval=interval),
        )
        for f, interval in zip(fields, (1, 3, 2), strict=True)
    ]
    calls: list[int] = []
    denoiser = native.adapter.component(native.denoisers[0])
    hook = denoiser.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        packed = native.run(batch).outputs
    finally:
        hook.remove()
    assert len(calls) == 4 * (2 if native.uses_cfg(batch[0]) and not native.batched_cfg else 1)  # packed calls
    reused = [out.step_cache["reused_steps"] for out in packed]
    assert reused[0] == 0 < reused[1], reused  # a call where rows compute beside rows that forecast
    for params, out in zip(batch, packed, strict=True):
        alone = native.run([params]).outputs[0]
        assert out.step_cache == alone.step_cache
        assert max_pixel_diff(outputs_of(native, out), outputs_of(native, alone)) <= case.merge_tolerance


@cases(lambda c: c.continuous)
def test_continuous_join_equals_its_singleton_runs(case: FamilyCase, native) -> None:
    d = native.defaults
    kw = {"width": d.width, "height": d.height, "num_frames": d.num_frames, "guidance_scale": d.guidance_scale}
    a = SamplingParams(prompt="a red square", seed=1, num_inference_steps=3, **kw)
    b = SamplingParams(prompt="a much longer prompt about a blue circle", seed=2, num_inference_steps=2, n=2, **kw)
    c = SamplingParams(prompt="green", seed=3, num_inference_steps=2, **kw)
    # b and c start together (one encoder call for texts of different lengths); a, b and c decode together
    got = simulate_steps(native, {0: [a], 1: [b, c]})
    for i, params in enumerate([a, b, c]):
        alone = outputs_of(native, native.run([params]).outputs[0])
        assert len(got[i]) == len(alone) == params.n
        assert max_pixel_diff(got[i], alone) <= 1, f"{case.id}: request {i} differs from its singleton run"


# -- residency ----------------------------------------------------------------------------------------------------

MODES = (ResidencyMode.COMPONENT_OFFLOAD, ResidencyMode.SNAPSHOT_OFFLOAD, ResidencyMode.LAYERWISE_OFFLOAD)


def _residency_cases() -> list:
    return [
        pytest.param(c.id, m.value, id=f"{c.id}-{m.value}") for c in BY_ID.values() if c.residency_batch for m in MODES
    ]


@pytest.mark.parametrize(("case", "mode"), _residency_cases(), indirect=["case"])
def test_residency_mode_reproduces_the_resident_output(case: FamilyCase, native, mode: str) -> None:
    """Component-, snapshot- or layer-wise offload of every component (layer-wise where it declares layers, whole
    otherwise): offloaded weights leave the device between requests, every component's weights come in for the
    request and go again, and the output equals the resident run."""
    layered = set(layered_components(native))
    assert layered, "a native family with repeated blocks must declare layers for layer-wise offload"
    assert not case.layered or layered == case.layered, layered
    for name, specs in case.layer_specs:
        assert default_layer_specs(name, native.components[name]) == list(specs)
    batch = [params_of(case, native, fields) for fields in case.residency_batch]
    reference = resident_run(native, batch)
    wanted = ResidencyMode(mode)
    modes = {
        name: wanted
        if wanted is not ResidencyMode.LAYERWISE_OFFLOAD or name in layered
        else ResidencyMode.COMPONENT_OFFLOAD
        for name in native.components
    }
    plan = DeploymentPlan(components={n: ComponentPlan(name=n, group=group_of(n), mode=m) for n, m in modes.items()})
    ledger = TransferLedger()
    manager = build_residency(plan, native.components, device="cpu", ledger=ledger)
    previous, native.residency = native.residency, manager
    try:
        assert {n: manager.describe()[n]["mode"] for n in modes} == {n: m.value for n, m in modes.items()}
        assert all(ledger.device_bytes(n) == 0 for n in modes)
        ledger.begin_window()
        offloaded = [outputs_of(native, out) for out in native.run(batch).outputs]
        moved = ledger.window_summary()
        assert all(moved.bytes(n) > 0 for n in modes), moved
        assert all(ledger.device_bytes(n) == 0 for n in modes)
    finally:
        native.residency = previous
        manager.close()
    for got, want in zip(offloaded, reference, strict=True):
        assert max_pixel_diff(got, want) <= case.residency_tolerance, mode
    if wanted is ResidencyMode.LAYERWISE_OFFLOAD:  # the declared layers really stream, not only whole components
        streamed = {
            (m.component, m.layer.rsplit(".", 1)[0]) for m in ledger.moves() if m.layer and m.direction == "h2d"
        }
        assert case.streamed_layers <= streamed, streamed


# -- request limits and reports ---------------------------------------------------------------------------------


@cases(lambda c: c.max_side or c.off_grid)
def test_sizes_beyond_the_positional_tables_or_off_the_grid_are_refused(case: FamilyCase, native) -> None:
    step = native.size_multiple
    refused = [(w, h) for w, h in case.off_grid]
    if case.max_side:
        assert native.max_width == native.max_height == case.max_side
        native.validate(SamplingParams(prompt="x", width=case.max_side, height=step))
        native.validate(SamplingParams(prompt="x", width=step, height=case.max_side))
        if case.max_side**2 <= native.max_pixels:  # (the server's pixel cap is its own, smaller, limit)
            native.validate(SamplingParams(prompt="x", width=case.max_side, height=case.max_side))
        refused.append((case.max_side + step, 64))
    for width, height in refused:
        with pytest.raises(
            InvalidRequestError, match=case.size_error_match if (width, height) not in case.off_grid else None
        ) as info:
            native.validate(SamplingParams(prompt="x", width=width, height=height))
        assert info.value.param == "size", (width, height)


def prompt_truncations(native: Any, text: str) -> list:
    """What the server reports for `text` as a prompt (server/common.py `prompt_warnings`)."""
    return list(native.prompt_tokens().count({"prompt": text}).truncations)


@cases(lambda c: c.warns_long_prompt)
def test_a_long_prompt_is_reported(native) -> None:
    assert prompt_truncations(native, "a red cat") == []
    found = prompt_truncations(native, " ".join(["a red cat on a mat"] * 200))
    assert found and {t.field for t in found} == {"prompt"}
    assert all(t.tokens > t.max_tokens for t in found) and "cut off" in found[0].message


@cases(lambda c: c.output == "image")
def test_usage_is_counted(native) -> None:
    from diffuserve.pipelines.prompt_limits import with_counter
    from diffuserve.server.usage import usage

    m = native.size_multiple
    params = SamplingParams(prompt="a red cat", negative_prompt="blurry", width=4 * m, height=2 * m, n=2)
    model = native.describe_model()
    # The server's one count of the request's texts (its own `PromptTokens`, from the tokenizer folders).
    texts = {"prompt": params.prompt, "negative_prompt": params.negative_prompt}
    owner = with_counter(model).prompt_tokens
    counted = usage(model, params, text_tokens=owner.count(texts).text_tokens, input_sizes=[(2 * m, 2 * m)])
    assert counted["output_tokens"] == 2 * 4 * 2
    assert counted["input_tokens_details"] == {
        "text_tokens": counted["input_tokens"] - 4,  # type: ignore[index]
        "image_tokens": 4,
    }
    assert counted["input_tokens"] > 4  # the prompt's text tokens are counted
    assert counted["total_tokens"] == counted["input_tokens"] + counted["output_tokens"]  # type: ignore[operator]


# -- a real server, the official client --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(case: FamilyCase, path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp(f"{case.id}-server")
    proc = ServerProcess(
        ["--model-path", str(path), "--served-model-name", f"tiny-{case.id}", *case.server_args], logs / "server.log"
    )
    proc.start(timeout_s=300)
    yield proc
    proc.stop()


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@cases(lambda c: c.server_request)
def test_server_answers_the_official_client_like_the_in_process_run(
    case: FamilyCase, native, subject: Subject, server: ServerProcess
) -> None:
    fields = dict(case.server_request)
    extra = {k: v for k, v in fields.items() if k not in ("prompt", "width", "height", "n")}
    result = client_of(server).images.generate(
        model=f"tiny-{case.id}",
        prompt=fields["prompt"],
        size=f"{fields['width']}x{fields['height']}",  # type: ignore[arg-type]
        n=fields["n"],
        response_format="b64_json",
        extra_body=extra,
    )
    got = [decode_b64_png(d.b64_json) for d in result.data]
    # What the request stands for: the family's default guidance where it gives none.
    params = SamplingParams(**{"guidance_scale": native.defaults.guidance_scale, **fields})
    if case.server_reference == "diffusers" and case.reference is not None:
        want = case.reference(subject, params)
    else:
        want = resident_run(native, [params])[0]
    assert [im.size for im in got] == [(params.width, params.height)] * params.n
    # Lossless PNG of the same pixels (Qwen-Image 2.1's VAE decodes RGBA, and the PNG keeps the alpha).
    assert [im.mode for im in got] == [im.mode for im in want]
    assert max_pixel_diff(got, want) <= case.server_tolerance
    m = native.size_multiple
    assert result.usage.output_tokens == params.n * (params.width // m) * (params.height // m)
    assert result.usage.input_tokens_details.text_tokens > 0
    assert result.usage.total_tokens == result.usage.input_tokens + result.usage.output_tokens
    if case.http_refused_size:
        with pytest.raises(openai.BadRequestError) as info:
            client_of(server).images.generate(
                model=f"tiny-{case.id}",
                prompt="a size it cannot run",
                size=case.http_refused_size,  # type: ignore[arg-type]
                extra_body={"num_inference_steps": 1},
            )
        body = info.value.body
        assert isinstance(body, dict)
        error = body.get("error", body)
        assert error["param"] == "size" and (case.http_refused_message or "") in error["message"]


# -- family facts that need the family's server ----------------------------------------------------------------


@pytest.mark.parametrize("case", ["flux2", "flux2-klein"], indirect=True)
def test_flux2_edits_through_the_official_client(case: FamilyCase, native, server: ServerProcess) -> None:
    client, model = client_of(server), f"tiny-{case.id}"
    common = {"width": 64, "height": 64, "num_inference_steps": 2, "guidance_scale": native.defaults.guidance_scale}
    reference = png(96, 80, seed=3)
    edited = client.images.edit(
        model=model,
        image=("ref.png", reference, "image/png"),
        prompt="make it red",
        size="64x64",
        n=2,
        extra_body={"seed": 4, "num_inference_steps": 2},
    )
    got = [decode_b64_png(d.b64_json) for d in edited.data]
    want = (
        native.run([SamplingParams(prompt="make it red", seed=4, n=2, image_inputs=(reference,), **common)])
        .outputs[0]
        .images
    )
    assert len(got) == 2 and max_pixel_diff(got, want) <= 1
    # The reference image conditions the output (native runs are deterministic, so any change is its effect;
    # a random tiny transformer at 2 steps moves the pixels only a little).
    (plain,) = native.run([SamplingParams(prompt="make it red", seed=4, **common)]).outputs[0].images
    assert max_pixel_diff([plain], want[:1]) > 0
    # Several references: the SDK sends a list as repeated image[] parts.
    second = png(64, 96, seed=8)
    edited = client.images.edit(
        model=model,
        image=[("a.png", reference, "image/png"), ("b.png", second, "image/png")],
        prompt="both",
        size="64x64",
        extra_body={"seed": 4, "num_inference_steps": 2},
    )
    got = [decode_b64_png(d.b64_json) for d in edited.data]
    want = (
        native.run([SamplingParams(prompt="both", seed=4, image_inputs=(reference, second), **common)])
        .outputs[0]
        .images
    )
    assert len(got) == 1 and max_pixel_diff(got, want) <= 1
    for images in ([("small.png", png(32, 32), "image/png")], [("r.png", reference, "image/png")] * 5):
        with pytest.raises(openai.BadRequestError) as info:
            client.images.edit(model=model, image=images, prompt="x")
        assert info.value.body["param"] == "image"


def _edit_extra(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: fields[k] for k in ("seed", "num_inference_steps", "negative_prompt", "true_cfg_scale")}


@pytest.mark.parametrize("case", ["qwen-image-edit"], indirect=True)
def test_qwen_edit_through_the_official_client(case: FamilyCase, native, server: ServerProcess) -> None:
    fields = dict(case.reference_params)["edit-n2"]
    head_reason = {"reason": "head:image_conditioning"}
    alone = metric_value(server.base_url, "diffuserve_batch_dispatches_total", head_reason)
    assert "warm-up generation" in server.log()
    result = client_of(server).images.edit(
        image=("in.png", RED, "image/png"),
        prompt=QWEN_EDIT["prompt"],
        n=2,
        size="64x64",
        extra_body=_edit_extra(fields),
    )
    got = [decode_b64_png(d.b64_json) for d in result.data]
    (want,) = resident_run(native, [SamplingParams(**fields)])
    assert [im.size for im in got] == [im.size for im in want] and max_pixel_diff(got, want) == 0
    # An edit is dispatched alone, for the image conditioning of the head of the queue.
    assert metric_value(server.base_url, "diffuserve_batch_dispatches_total", head_reason) == alone + 1


@pytest.mark.parametrize("case", ["qwen-image-edit-plus"], indirect=True)
def test_qwen_edit_plus_takes_an_image_list_through_the_official_client(
    case: FamilyCase, native, server: ServerProcess
) -> None:
    fields = dict(case.reference_params)["two-images"]
    client = client_of(server)
    # A list is sent as repeated `image[]` parts, as the SDK does for several images.
    result = client.images.edit(
        image=[("a.png", RED, "image/png"), ("b.png", BLUE_WIDE, "image/png")],
        prompt=QWEN_EDIT["prompt"],
        size="64x64",
        extra_body=_edit_extra(fields),
    )
    got = [decode_b64_png(d.b64_json) for d in result.data]
    (want,) = resident_run(native, [SamplingParams(**fields)])
    assert [im.size for im in got] == [im.size for im in want] and max_pixel_diff(got, want) == 0
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=[("a.png", RED, "image/png")] * 4, prompt=QWEN_EDIT["prompt"], size="64x64")
    assert info.value.body["param"] == "image" and "1 to 3 images" in info.value.body["message"]


@pytest.mark.parametrize("case", ["hunyuan-video"], indirect=True)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks its video methods deprecated
def test_hunyuan_video_create_and_poll_then_download(case: FamilyCase, server: ServerProcess) -> None:
    client = client_of(server)
    video = client.videos.create_and_poll(prompt="a red fox", size="32x32", seconds="1")
    assert (video.status, video.size, video.model) == ("completed", "32x32", f"tiny-{case.id}")
    data = client.videos.download_content(video.id).read()
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    # 1 s at the checkpoint's 8 fps -> the nearest 4k+1 frame count, 9.
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)
    assert np.ptp(np.stack(frames)) > 0
