from moeshrink.core.errors import MoeshrinkError


class OrganismError(MoeshrinkError, ValueError):
    """A world, recipe or tokenizer that cannot make the organism asked for."""


# The trainer's (train.py's) revision, raised whenever a change there changes what a recipe trains:
# a checkpoint shipped by an older trainer is refused and a scratch run reruns.
# 2: documents packed in a row attend only to themselves.
TRAINER_REVISION = 2
