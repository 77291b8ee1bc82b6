"""``add_flag``: every flag of the parser is added through it, so every flag has a help text."""


def add_flag(group, *flags, help, **kw):  # noqa: A002 - argparse's name
    """``group.add_argument`` with ``help`` required (every flag documents itself)."""
    group.add_argument(*flags, help=help, **kw)
