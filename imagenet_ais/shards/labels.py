"""A sample's image member and its label, by the rule its manifest names (``index --label``).

Shards made by ``convert`` hold ``KEY.jpg`` and ``KEY.cls`` (the class index in ASCII digits);
shards made elsewhere may hold PNG or WebP images and keep the label in ``KEY.json`` or
``KEY.txt``. A rule says which member holds the label; a label is a class index (digits, or a
JSON integer) or a class name, found in the manifest's ``classes``. ``index`` and the loader judge
a sample with the same ``problem``, so the samples a manifest counts are the ones a reader finds.
Nothing here is unpickled: JSON and text are parsed, images only named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from imagenet_ais.errors import ConfigError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
RULES = "cls, txt or json:FIELD"


@dataclass(frozen=True)
class LabelRule:
    """Which member holds a sample's label: ``cls`` (the default), ``txt``, or ``json`` with its
    ``field`` (a key, or keys joined by dots for nested objects)."""

    member: str = "cls"
    field: str = ""

    @classmethod
    def parse(cls, text: str) -> LabelRule:
        """``cls``, ``txt`` or ``json:FIELD``; anything else is a one-line ConfigError."""
        member, _, field = text.partition(":")
        if member in ("cls", "txt") and not field:
            return cls(member)
        if member == "json" and field and all(field.split(".")):
            return cls(member, field)
        raise ConfigError(f"label rule {text!r}: give {RULES} (e.g. json:label)")

    def __str__(self) -> str:
        return f"json:{self.field}" if self.member == "json" else self.member

    @property
    def exts(self) -> tuple[str, ...]:
        """The members a reader of this rule reads: the images' and the label's."""
        return (*IMAGE_EXTS, self.member)

    def wanted(self, member: str) -> bool:
        """Whether a reader of this rule reads the tar member named ``member``."""
        return member.rpartition("/")[2].partition(".")[2].lower() in self.exts

    def value(self, sample: dict) -> int | str:
        """The label of a grouped sample (its members' bytes by extension): an index or a name.
        A missing or unreadable label is a ValueError with the reason."""
        if self.member not in sample:
            raise ValueError(f"no .{self.member} member")
        data = sample[self.member]
        text = data.decode("utf-8", "replace").strip() if isinstance(data, bytes) else str(data)
        if self.member == "cls":
            if not text.isascii() or not text.isdigit():
                raise ValueError(f".cls {text[:20]!r} is not a class index")
            return int(text)
        if self.member == "txt":
            if not text:
                raise ValueError(".txt is empty")
            return int(text) if text.isascii() and text.isdigit() else text
        return self._json_value(data)

    def _json_value(self, data: bytes) -> int | str:
        try:
            value: object = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f".json is not JSON ({e})") from None
        for key in self.field.split("."):
            if not isinstance(value, dict) or key not in value:
                raise ValueError(f".json has no {self.field!r}")
            value = value[key]
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        if isinstance(value, str) and value.strip():
            text = value.strip()
            return int(text) if text.isascii() and text.isdigit() else text  # (digits: an index, as .txt's)
        raise ValueError(f".json's {self.field!r} is {json.dumps(value)[:20]}, not a class index or name")

    def problem(self, sample: dict) -> str | None:
        """Why a grouped sample cannot be trained on (no image member, no readable label), else None."""
        if not any(e in sample for e in IMAGE_EXTS):
            return f"no image member (.{', .'.join(IMAGE_EXTS)})"
        try:
            self.value(sample)
        except ValueError as e:
            return str(e)
        return None

    def index(self, sample: dict, classes: dict[str, int]) -> int:
        """The class index of a sample's label, its name looked up in ``classes``; a ValueError
        where the name is not there."""
        value = self.value(sample)
        if isinstance(value, int):
            return value
        if value not in classes:
            raise ValueError(f"label {value[:40]!r} is not a class of the manifest")
        return classes[value]


def image_member(sample: dict) -> bytes:
    """The bytes of a grouped sample's image (StopIteration where it has none)."""
    return next(sample[e] for e in IMAGE_EXTS if e in sample)
