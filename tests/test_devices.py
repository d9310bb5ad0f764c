"""The device setting: its names, what `auto` resolves to with and without GPUs and under torchrun, errors that
name the setting, and the start-up line; the tokenizer-only target of `wingspan vocab`; freed CPU memory handed
back to the system; the process's first vector-math call made from one thread."""

import pytest
import torch

from wingspan import devices
from wingspan.config import TrainConfig
from wingspan.devices import device_name, release_freed_memory, resolve_device, use_cpu_threads
from wingspan.errors import ConfigError
from wingspan.models.target import TargetModel, TargetVocabulary


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_accepted(name):
    assert device_name(name) == name


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CPU", "mps", ""])
def test_other_device_names_are_config_errors(name):
    with pytest.raises(ConfigError, match="auto .*cpu, cuda or cuda:N"):
        device_name(name)


def test_train_config_names_the_device_field():
    with pytest.raises(ConfigError, match="^device: device 'gpu'"):
        TrainConfig(device="gpu")
    assert TrainConfig().device == "auto"


def test_auto_and_cpu_resolve_to_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_asking_for_a_missing_gpu_is_an_error_not_the_cpu(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve_device(name)


def test_auto_takes_the_ranks_gpu_under_torchrun(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)  # an explicit index wins
    with pytest.raises(ConfigError, match="has 4 GPU"):
        resolve_device("cuda:4")
    assert resolve_device("cpu") == torch.device("cpu")


def test_threads_are_set_on_the_cpu_only():
    before = torch.get_num_threads()
    try:
        use_cpu_threads(torch.device("cuda", 0), 1)
        assert torch.get_num_threads() == before
        use_cpu_threads(torch.device("cpu"), 1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_target_load_announces_device_and_dtype(tiny_llama_dir, capsys):
    target = TargetModel.load(str(tiny_llama_dir), dtype="float32", device="cpu")
    assert target.device == torch.device("cpu")
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("target ")]
    assert line.startswith(f"target {tiny_llama_dir}: device cpu (") and line.endswith("dtype float32")


def test_a_target_load_makes_the_first_vector_math_call_before_the_model_loads(tiny_llama_dir, monkeypatch):
    import wingspan.models.target as target_module

    calls = []
    from_pretrained = target_module.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(target_module, "start_vector_math", lambda: calls.append("vector math"))
    monkeypatch.setattr(
        target_module.AutoModelForCausalLM,
        "from_pretrained",
        lambda *args, **kwargs: calls.append("model") or from_pretrained(*args, **kwargs),
    )
    TargetModel.load(str(tiny_llama_dir), dtype="float32", device="cpu")
    assert calls == ["vector math", "model"]


def test_the_first_vector_math_call_is_one_element_so_one_thread():
    # a large first call, split between threads, sometimes computes a share less accurately (docs/reliability.md)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as trace:
        devices.start_vector_math()
    assert [(e.name, e.input_shapes) for e in trace.events() if e.name == "aten::exp"] == [("aten::exp", [[1]])]


def test_tokenizer_only_target_equals_the_loaded_model(tiny_llama_dir):
    model = TargetModel.load(str(tiny_llama_dir), dtype="float32", device="cpu")
    text = TargetVocabulary.load(str(tiny_llama_dir))
    assert text.vocab_size == model.vocab_size
    assert text.eos_token_ids == model.eos_token_ids
    assert text.tokenizer.get_vocab() == model.tokenizer.get_vocab()


def resident_anonymous_mib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("RssAnon:"))


@pytest.mark.skipif(devices._LIBC is None, reason="glibc's malloc_trim only")
def test_freed_heap_memory_goes_back_to_the_system():
    blocks = [torch.ones(25_000) for _ in range(4000)]  # 100 KB each: glibc serves them from its heap
    kept = blocks[-1]  # the heap's top stays in use, so glibc cannot shrink it by itself
    del blocks
    before = resident_anonymous_mib()
    release_freed_memory()
    assert before - resident_anonymous_mib() > 200  # of the 400 MB freed
    assert kept.sum() == 25_000
