"""Progress lines of a multi-rank run: printed once, by rank 0."""


def print_line(message):
    print(message, flush=True)


def rank0_log(rank):
    """A ``log(message)`` that prints on rank 0 and does nothing elsewhere."""
    return print_line if rank == 0 else _quiet


def _quiet(message):
    pass
