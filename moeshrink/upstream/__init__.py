"""Stage 1: the upstream checkpoint (hub, local folder or the organism) and its exact bf16 twin."""
