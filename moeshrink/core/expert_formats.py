"""The expert formats a build may re-encode its routed experts in, one entry each: all that the config
check, the builder, the bf16 twin, the planner and the CLI know of a format. A format is one module
that calls `register` when imported: the built-in ones are listed in `REGISTRY`, others are found as
`core.plugins` says (the `moeshrink.formats` entry-point group, MOESHRINK_PLUGINS). Serving it takes
its vLLM kernel too.

The entry itself is header-only knowledge (no torch); the encoder and decoder live in its `codec`
module, imported when a tensor is encoded or decoded. A codec module provides
`encode(weight, bits, name) -> (codes, scales)` (with `importance=` where the entry says
`weighted_encoder`), `decode(codes, scales, dtype, name) -> weight` and
`quantization_config(fmt, expert_bits, source_format) -> dict` (the build's config.json entry).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from moeshrink.core import plugins
from moeshrink.core.errors import MoeshrinkError


class FormatError(MoeshrinkError, ValueError):
    pass


@dataclass(frozen=True)
class ExpertFormat:
    name: str                   # builds.<id>.quantize.format
    quant_method: str           # quantization_config.quant_method of a build in this format
    code_bits: tuple[int, ...]  # the code widths an expert may take, ascending
    default_budget: float       # routed-expert bits per weight when a build sets none, overhead counted
    group: int                  # weights per block scale
    scale_bits: int             # bits of one block scale (whole bytes)
    codes_suffix: str           # the tensor-name suffixes that replace an expert weight's `weight`
    scales_suffix: str
    codec: str                  # the module that encodes and decodes (imports torch)
    # the stem of the tables the encoder loads, one per code width, that a run writes once under
    # results/<run>/formats/ (codec.write_encoder_table, codec.load_encoder_table); None: it keeps none
    encoder_table: str | None = None
    # the file of format constants the codec encodes with and the tables are made from (TWX v2's codebooks)
    constants: Path | None = None
    # its codec's encode takes `importance` (one value per input column, from calibration activations)
    # and weighs each weight's squared error by it
    weighted_encoder: bool = False

    def bits_per_weight(self, bits: int) -> float:
        """One code width's bits per weight, its block scale included."""
        return bits + self.scale_bits / self.group

    def budget_problem(self, budget: float, where: str) -> str | None:
        """Why a routed-expert bit budget cannot be met in this format, or None."""
        least, most = self.bits_per_weight(self.code_bits[0]), self.bits_per_weight(self.code_bits[-1])
        if budget < least:
            return f"{where}: {self.name} stores at least {least:g} bits per weight, more than {budget:g}"
        if budget > most:
            return f"{where}: {self.name} stores at most {most:g} bits per weight; {budget:g} is not a budget it can use"
        return None

    def mean_code_bits(self, budget: float) -> float:
        """The code bits per weight a build with this budget averages (what a size model needs)."""
        return min(float(self.code_bits[-1]), budget - self.scale_bits / self.group)

    def stored_tensors(self, stem: str, rows: int, inputs: int, bits: float) -> list[tuple[str, str, tuple[int, int]]]:
        """(name, safetensors dtype, shape) of the tensors replacing the weight `<stem>.weight` [rows, inputs]."""
        return [(f"{stem}.{self.codes_suffix}", "U8", (rows, int(inputs * bits / 8))),
                (f"{stem}.{self.scales_suffix}", "U8", (rows, inputs // self.group * self.scale_bits // 8))]

    def encoder_tables(self) -> list[str]:
        """The file names of its encoder's tables (under a run's `formats/` folder), one per code width."""
        return [f"{self.encoder_table}-{bits}bit.safetensors" for bits in self.code_bits] if self.encoder_table else []

    def constants_sha256(self) -> str | None:
        from moeshrink.core.ioutil import sha256_file

        return sha256_file(self.constants) if self.constants else None

    def codec_module(self) -> ModuleType:
        return importlib.import_module(self.codec)

    def output_aware_steps(self) -> tuple[str, ...]:
        """What calibration text can decide in this format (builds.<id>.quantize.output_aware): which
        experts take the wider codes (two or more code widths), and the encoder's error weights."""
        return tuple(step for step, can in (("allocation", len(self.code_bits) > 1), ("encoder", self.weighted_encoder))
                     if can)


def output_aware_problems(quantize_spec: dict, where: str) -> list[str]:
    """Why a build's quantize calibration and output_aware list (under `where`) do not fit its format."""
    fmt, steps = get(quantize_spec["format"], f"{where}.format"), quantize_spec.get("output_aware")
    if quantize_spec.get("calibration") is None:
        return [f"{where}.output_aware: needs {where}.calibration (the text it reads)"] if steps else []
    can = fmt.output_aware_steps()
    if not can:
        return [f"{where}.calibration: {fmt.name} has one code width and an encoder that weighs no error, so "
                "calibration text decides nothing in it"]
    return [f"{where}.output_aware: {fmt.name} cannot take {step!r} from calibration text (it can: {', '.join(can)})"
            for step in steps or () if step not in can]


def calibrated_steps(quantize_spec: dict | None) -> tuple[str, ...]:
    """What a build's quantize calibration text decides: its `output_aware` list, or every step its format
    can take; none without calibration text."""
    if not quantize_spec or quantize_spec.get("calibration") is None:
        return ()
    return tuple(quantize_spec.get("output_aware") or get(quantize_spec["format"], "quantize.format").output_aware_steps())


# the built-in TWX3 and TWX2.5 register in twx_layout; other packages' formats come through the entry points
REGISTRY: plugins.Registry[ExpertFormat] = plugins.Registry(
    "expert format", ("moeshrink.formats.twx_layout",), "moeshrink.formats", name=lambda fmt: fmt.name,
    origin=lambda fmt: fmt.codec, error=FormatError)
register = REGISTRY.register
formats = REGISTRY.entries
get = REGISTRY.get


def table_owner(table: str, bits: int | None = None) -> ExpertFormat:
    """A format whose encoder keeps tables named `table` (at `bits`, when given)."""
    for fmt in formats().values():
        if fmt.encoder_table == table and (bits is None or bits in fmt.code_bits):
            return fmt
    at = f" at {bits} bits" if bits is not None else ""
    raise FormatError(f"no expert format keeps an encoder table {table!r}{at}")


def quant_methods() -> list[str]:
    return sorted({fmt.quant_method for fmt in formats().values()})


def encoded_weight(name: str, names: set[str]) -> tuple[ExpertFormat, str, str] | None:
    """For the codes tensor of an encoded weight: its format, the weight's name and the scales' name."""
    for fmt in formats().values():
        suffix = "." + fmt.codes_suffix
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if f"{stem}.{fmt.scales_suffix}" in names:
                return fmt, stem + ".weight", f"{stem}.{fmt.scales_suffix}"
    return None


def is_scales(name: str, names: set[str]) -> bool:
    """The scales tensor of an encoded weight: read with its codes, never on its own."""
    return any(name.endswith("." + fmt.scales_suffix)
               and name[: -len(fmt.scales_suffix)] + fmt.codes_suffix in names for fmt in formats().values())


def logical_name(name: str) -> str:
    """The weight an encoded tensor stands for (`x.twx_codes` -> `x.weight`); any other name unchanged."""
    for fmt in formats().values():
        for suffix in (fmt.codes_suffix, fmt.scales_suffix):
            if name.endswith("." + suffix):
                return name[: -len(suffix)] + "weight"
    return name
