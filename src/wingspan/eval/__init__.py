"""Evaluation of a draft: prompt sets (prompts.py), speculative vs greedy decoding side by side (runner.py),
results.json / results.md / acceptance.png (report.py). `vllm_referee.py` is a standalone script for the vllm venv.
"""
