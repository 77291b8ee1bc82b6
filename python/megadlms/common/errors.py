"""How every config dataclass reports bad values: all problems at once, named by field.

Each ``__post_init__`` collects its problems in a :class:`Problems` and raises one
:class:`ConfigError` listing them. Messages name the dataclass FIELD (``hidden_size``),
never a command-line flag: the CLI layer (``megadlms.config``) maps field
names back to flags when it reports them (docs/architecture.md, "Configuration").
"""

from __future__ import annotations

from typing import List


class ConfigError(ValueError):
    """One or more invalid fields of the config class ``owner``; ``problems`` lists them."""

    def __init__(self, owner: str, problems: List[str]) -> None:
        self.owner = owner
        self.problems = list(problems)
        super().__init__(f"invalid {owner}: " + "; ".join(self.problems))


class Problems:
    """Collects the problems of one config object; :meth:`raise_if_any` at the end."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.items: List[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def check(self, ok: bool, message: str) -> bool:
        """Record ``message`` unless ``ok``; returns ``ok`` so dependent checks can be skipped."""
        if not ok:
            self.items.append(message)
        return ok

    def positive(self, obj, *names: str, required: bool = True) -> None:
        """Each named field must be a positive int (or None when not ``required``)."""
        for name in names:
            value = getattr(obj, name)
            if value is None:
                if required:
                    self.items.append(f"{name} is required")
            elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                self.items.append(f"{name} must be a positive integer, got {value!r}")

    def member(self, obj, name: str, enum_cls, *, optional: bool = False) -> None:
        """Field ``name`` of ``obj`` becomes the member of ``enum_cls`` its value names (a config
        accepts the member or its value string); an unknown value is a problem listing the
        choices. ``optional``: None is allowed and kept."""
        value = getattr(obj, name)
        if value is None and optional:
            return
        try:
            object.__setattr__(obj, name, enum_cls(value))  # frozen dataclasses too
        except ValueError:
            choices = tuple(m.value for m in enum_cls)
            self.items.append(f"{name} must be one of {choices}, got {value!r}")

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.owner, self.items)
