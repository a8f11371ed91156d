from moeshrink.core.errors import MoeshrinkError


class OrganismError(MoeshrinkError, ValueError):
    """A world, recipe or tokenizer that cannot make the organism asked for."""
