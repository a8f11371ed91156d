"""Stage 3: a build's vLLM server (supervisor, lease, endpoint, log) and its memory, predicted and measured."""
