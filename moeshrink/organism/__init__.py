from moeshrink.core.errors import MoeshrinkError


class OrganismError(MoeshrinkError, ValueError):
    """A world, recipe or tokenizer that cannot make the organism asked for."""


# The trainer's (train.py's) revision, raised whenever a change there changes what a recipe trains:
# a checkpoint shipped by an older trainer is refused and a scratch run reruns.
# 2: packed documents attend to each other only under `train.packing: stream` (under 1 they always
# did, at restarted positions).
TRAINER_REVISION = 2
