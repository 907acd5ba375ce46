"""Linear layers in FP8 (E4M3) on Hopper-class GPUs (`Quantization.FP8`), through
`torch._scaled_mm`.

Each weight is quantized once, at load: one scale per output channel (max |w| / 448,
E4M3's largest finite value). Each product quantizes its input on the fly with one
scale per row (per token), multiplies in FP8 with float32 sums, applies both scales
and the bias in the product's epilogue, and returns bfloat16 (what row-wise scaled
products return), so a model quantized this way runs in bfloat16.

The sums: Hopper's tensor cores add FP8 products in a precision of their own, and a
product either promotes its partial sums to float32 every few steps or, with fast
accumulation, not at all. Every product promotes as shipped: fast accumulation
(FAST_ACCUMULATION_MAX_INPUTS, for the benchmarks) made large-v3's encoder faster and
failed the accuracy gate on the multilingual set (docs/performance.md).

A row's scale is its own: unlike int8's whole-input scale (`cpu_int8`), a clip's result
does not depend on the clips encoded beside it.

Which layers: the ones that multiply the encoder's 1,500 positions per window (every
encoder layer's projections and MLP, and the decoder's cross-attention K/V
projections of the encoder's output): there a window's time is the products'. The
decoder's own per-token products, bound by memory at the batch sizes served, stay in
bfloat16, as do the convolutions, attention, layer norms and embeddings.

On a GPU one Triton kernel reads each input row once and writes its FP8 values and
scale (`_quantize_rows`); elsewhere (the CPU, for tests) PyTorch computes the same. The
MLP's GELU is computed inside the quantization of the second product's input, and the
encoder's output is quantized once for all the decoder layers' K/V projections. A layer
norm before a product writes its output quantized, adding the residual it normalises
first where there is one (`norm_quantize`, `_norm_quantize_rows`): one pass over the
rows instead of an addition, a layer norm and a quantization, each reading what the one
before wrote.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch of a CI machine
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest scale: a row of zeros quantizes to zeros instead of dividing by zero.
MIN_SCALE = torch.finfo(torch.float32).tiny
# Rows of a quantized input are padded to a multiple of this for the FP8 product.
ROW_MULTIPLE = 16
OUTPUT_DTYPE = torch.bfloat16
# Elements each program of the two kernels holds, as whole rows, a power of two of them
# (`_rows_per_program`): one of the MLP's 4 x 1,280-wide inputs, two of the 1,280-wide
# ones. bench.fp8_kernels sweeps these settings: four warps were fastest for the wide
# rows, with GELU or without, in each of its records (the large-models record).
QUANTIZE_ELEMENTS = 4096
QUANTIZE_WARPS = 4
NORM_WARPS = 4
# The widest input a product sums with fast accumulation (`use_fast_accum`); 0: none, as
# shipped. bench.fp8_accuracy's "fp8, fast accumulation" sets 1,280, large-v3's width:
# bench.fp8_products found it paying on the products of 1,280 inputs and not on fc2's
# 5,120, where its error was three times promotion's.
FAST_ACCUMULATION_MAX_INPUTS = 0
FAST_ACCUMULATION_TRIED = 1280
# The smallest second block of a row (`row_blocks`): a row of a power of two has one,
# wholly masked.
MIN_BLOCK = 16


class GeluForm(enum.IntEnum):
    """How the quantization of fc2's input computes GELU (`_gelu`). bench.fp8_kernels times
    them and bench.fp8_accuracy scores them on real weights."""

    POLYNOMIAL_ERF = 0  # x/2 (1 + erf(x/sqrt 2)), erf by a polynomial within 1.5e-7
    LIBDEVICE_ERF = 1  # the same with libdevice's erf, as F.gelu computes it
    TANH = 2  # x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), F.gelu(approximate="tanh")
    TANH_APPROX = 3  # the same, tanh by the GPU's one-instruction approximation (tanh.approx.f32)
    SIGMOID = 4  # the tanh form as x sigmoid(2u) = x / (1 + 2^(-2u log2 e)): one exp2, one division
    SIGMOID_FAST_DIVIDE = 5  # the same, divided by the GPU's approximate division (div.approx.f32)

    @property
    def tanh_form(self) -> bool:
        return self not in (GeluForm.POLYNOMIAL_ERF, GeluForm.LIBDEVICE_ERF)

    @property
    def ptx(self) -> bool:
        """Whether its kernel holds a PTX instruction of its own: compiled code only, which
        Triton's interpreter cannot run."""
        return self in (GeluForm.TANH_APPROX, GeluForm.SIGMOID_FAST_DIVIDE)


# The tanh form: its kernel takes a quarter less time than the polynomial's, and it
# differs from the erf forms far less than FP8's own rounding, which already moves
# transcripts as much as swapping the two erf forms does (the large-models record).
# Its sigmoid forms compute the same function in fewer instructions, and failed the
# accuracy gate all the same: a last-bit change moved one recording (docs/performance.md).
GELU = GeluForm.TANH


def problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a model on `device` in `dtype` cannot run FP8 products, or None."""
    if device.type != "cuda":
        return f"fp8 quantization runs on a CUDA GPU, not on {device}"
    if dtype != OUTPUT_DTYPE:
        return f"fp8 quantization keeps the rest of the model in bfloat16, not {dtype}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        name, version = torch.cuda.get_device_name(device), ".".join(map(str, capability))
        return f"fp8 quantization needs FP8 tensor cores (compute capability 8.9 or later); {name} has {version}"
    return None


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> its FP8 values [out, in] and their scales [1, out] (float32)."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (weight / scales[:, None]).to(FP8), scales[None, :].contiguous()


def quantize_rows_reference(x: torch.Tensor, *, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (or GELU(x), computed in float32) -> FP8 values [rows, cols] and
    per-row scales [rows, 1] (float32). Values are x times the scale's reciprocal,
    computed once per row: a product per element rounds the same everywhere, where a
    division per element costs a GPU more."""
    x = x.float()
    if gelu:
        x = F.gelu(x, approximate="tanh" if GELU.tanh_form else "none")
    scales = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x * (1.0 / scales)).to(FP8), scales


def quantize_rows(x: torch.Tensor, *, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """As `quantize_rows_reference`, with the rows padded to a multiple of ROW_MULTIPLE
    (zeros, scale 1) on a GPU, in one kernel there."""
    if triton is None or x.device.type != "cuda":
        return quantize_rows_reference(x, gelu=gelu)
    rows, cols = x.shape
    values, scales = _quantized_buffers(rows, cols, x.device)
    padded = values.shape[0]
    head, tail = row_blocks(cols)
    rows_per_program = _rows_per_program(head + tail)
    _quantize_rows[(padded // rows_per_program,)](
        x, x.stride(0), values, scales, rows, cols, GELU=gelu, GELU_FORM=int(GELU),
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, HEAD=head, TAIL=tail, ROWS=rows_per_program, num_warps=QUANTIZE_WARPS,
    )
    return values, scales


def _quantized_buffers(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised FP8 values [padded, cols] and float32 scales [padded, 1], the rows
    padded to a multiple of ROW_MULTIPLE (the kernels write the padding too)."""
    padded = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
    return (torch.empty(padded, cols, dtype=FP8, device=device),
            torch.empty(padded, 1, dtype=torch.float32, device=device))


def row_blocks(cols: int) -> tuple[int, int]:
    """A row of `cols` as two blocks of powers of two, the first whole (`cols`' largest
    power of two), the second masked where it passes `cols`: 5,120 = 4,096 + 1,024,
    1,280 = 1,024 + 256. One block of the next power of two would leave up to half its
    lanes idle, each still computing (GELU's erf is most of a wide row's time)."""
    head = 1 << (cols.bit_length() - 1)
    rest = cols - head
    return head, max(MIN_BLOCK, 1 << (rest - 1).bit_length() if rest else 0)


def _rows_per_program(elements: int) -> int:
    """Whole rows a program holds: a power of two (so it divides the padded rows) up to ROW_MULTIPLE."""
    return min(ROW_MULTIPLE, 1 << max(0, (QUANTIZE_ELEMENTS // elements).bit_length() - 1))


def norm_quantize_reference(
    x: torch.Tensor, norm: nn.LayerNorm, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """x [rows, cols] (plus `residual`, added in x's dtype) -> that sum, and its layer
    norm (in x's dtype, as `norm` computes it) quantized by `quantize_rows_reference`."""
    if residual is not None:
        x = x + residual
    return x, quantize_rows_reference(norm(x))


def norm_quantize(
    x: torch.Tensor, norm: nn.LayerNorm, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, QuantizedInput]:
    """As `norm_quantize_reference`, for x [..., cols] (x itself where there is no
    residual), the quantized rows padded as `quantize_rows` pads them; in one kernel on a
    GPU."""
    shape = x.shape
    if triton is None or x.device.type != "cuda":
        total, (values, scales) = norm_quantize_reference(x.reshape(-1, shape[-1]), norm, _rows(residual))
        return x if residual is None else total.reshape(shape), QuantizedInput(values, scales, shape)
    x = x.contiguous()
    rows, cols = shape.numel() // shape[-1], shape[-1]
    values, scales = _quantized_buffers(rows, cols, x.device)
    padded = values.shape[0]
    total = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(cols)
    rows_per_program = _rows_per_program(block)
    _norm_quantize_rows[(padded // rows_per_program,)](
        x, x if residual is None else residual.contiguous(), total, norm.weight, norm.bias, values, scales,
        rows, cols, norm.eps, ADD=residual is not None,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block, ROWS=rows_per_program, num_warps=NORM_WARPS,
    )
    return total, QuantizedInput(values, scales, shape)


def _rows(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.reshape(-1, x.shape[-1])


@dataclass(frozen=True)
class QuantizedInput:
    """An input quantized once for several products (the decoder layers' cross-attention
    K/V projections all multiply the same audio features)."""

    values: torch.Tensor  # [padded rows, cols] FP8
    scales: torch.Tensor  # [padded rows, 1] float32
    shape: torch.Size  # the input's, [..., cols]

    @classmethod
    def of(cls, x: torch.Tensor) -> QuantizedInput:
        values, scales = quantize_rows(x.reshape(-1, x.shape[-1]))
        return cls(values, scales, x.shape)


def fp8_linear(
    x: torch.Tensor | QuantizedInput, weight: torch.Tensor, weight_scales: torch.Tensor, bias: torch.Tensor | None,
    *, gelu: bool = False,
) -> torch.Tensor:
    """≈ F.linear(x, w, bias) (or of GELU(x)) with `weight, weight_scales = quantize_weight(w)`:
    x [..., in] -> [..., out] in bfloat16."""
    quantized = x if isinstance(x, QuantizedInput) else None
    if quantized is None:
        values, scales = quantize_rows(x.reshape(-1, x.shape[-1]), gelu=gelu)
        quantized = QuantizedInput(values, scales, x.shape)
    out = torch._scaled_mm(
        quantized.values, weight.t(), scale_a=quantized.scales, scale_b=weight_scales, bias=bias,
        out_dtype=OUTPUT_DTYPE, use_fast_accum=fast_accumulation(weight.shape[1]),
    )
    rows = quantized.shape.numel() // quantized.shape[-1]
    return out[:rows].reshape(*quantized.shape[:-1], weight.shape[0])


def fast_accumulation(inputs: int) -> bool:
    """Whether a product of `inputs` inputs sums with fast accumulation (FAST_ACCUMULATION_MAX_INPUTS)."""
    return inputs <= FAST_ACCUMULATION_MAX_INPUTS


class Fp8Linear(nn.Module):
    """An nn.Linear whose product runs in FP8. The float weight is dropped; the FP8 one
    and its scales are buffers, the bias stays (in bfloat16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        values, scales = quantize_weight(weight)
        self.register_buffer("weight_fp8", values)
        self.register_buffer("weight_scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().to(OUTPUT_DTYPE))

    @classmethod
    def of(cls, linear: nn.Linear) -> Fp8Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor | QuantizedInput) -> torch.Tensor:
        return fp8_linear(x, self.weight_fp8, self.weight_scales, self.bias)

    def of_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """self(F.gelu(x)), the GELU computed in float32 inside the input's quantization."""
        return fp8_linear(x, self.weight_fp8, self.weight_scales, self.bias, gelu=True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


if triton is not None:

    @triton.jit
    def _gelu(x, GELU_FORM: tl.constexpr):
        # The quantization of a 5,120-wide row with GELU is bound by GELU's instructions,
        # not by memory (docs/performance.md): hence the cheaper forms. Each branch assigns
        # `gelu` and one return ends the function: Triton 3.6 refuses a return in a branch.
        if GELU_FORM >= 4:
            gelu = _sigmoid_gelu(x, GELU_FORM)
        else:
            if GELU_FORM == 1:  # GeluForm.LIBDEVICE_ERF
                doubled = 1.0 + tl.erf(x * 0.7071067811865476)
            elif GELU_FORM == 2:
                # GeluForm.TANH: within 4.8e-4 of the erf form (1.8e-4 of |x|), far below the FP8
                # step of 1/16 of a value it is quantized to; 1 + tanh(u) = 2 - 2 / (e^2u + 1),
                # which stays finite where e^2u overflows.
                u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
                doubled = 2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
            elif GELU_FORM == 3:
                # GeluForm.TANH_APPROX: the special-function unit's tanh, one instruction
                # where the exact form needs an exponential and a division; PTX documents its
                # error at about 2^-11 relative, still far below an FP8 step. Compiled code only:
                # Triton's interpreter cannot run PTX.
                u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
                tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32,
                                                 is_pure=True, pack=1)
                doubled = 1.0 + tanh
            else:
                # GeluForm.POLYNOMIAL_ERF: erf within 1.5e-7 of its value (Abramowitz and Stegun
                # 7.1.26), below float32's step at GELU's output, at a fraction of libdevice's
                # erf's instructions.
                z = tl.abs(x) * 0.7071067811865476
                t = 1.0 / (1.0 + 0.3275911 * z)
                tail = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
                tail = tail * tl.exp(-z * z)  # 1 - erf(z)
                doubled = tl.where(x >= 0, 2.0 - tail, tail)  # 1 + erf(x / sqrt 2)
            gelu = 0.5 * x * doubled
        return gelu

    @triton.jit
    def _sigmoid_gelu(x, GELU_FORM: tl.constexpr):
        # GeluForm.SIGMOID: 1 + tanh(u) = 2 / (1 + e^-2u), so GELU is x / (1 + 2^z) with
        # z = -2u log2(e), its two constants folded into one polynomial: the tanh form's
        # function in fewer instructions (the exponential and the division each round
        # within a few float32 steps, as the tanh form's do). 2^z overflowing gives
        # x / inf = 0, GELU's limit.
        z = x * (-2.302208198144325 - 0.1029432395800235 * (x * x))
        if GELU_FORM == 4:
            gelu = x / (1.0 + tl.exp2(z))
        else:
            # GeluForm.SIGMOID_FAST_DIVIDE: Triton's division (div.full.f32) first scales
            # its operands so that any divisor works; div.approx.f32 skips that and is as
            # close (2 ulp, PTX's figure) for divisors up to 2^126. Past it, where it
            # returns 0, the quotient is below 2^-126 |x|: GELU's limit again. Compiled
            # code only, as GeluForm.TANH_APPROX.
            gelu = tl.inline_asm_elementwise("div.approx.f32 $0, $1, $2;", "=f,f,f", [x, 1.0 + tl.exp2(z)],
                                             dtype=tl.float32, is_pure=True, pack=1)
        return gelu

    # `stride` is specialised (its divisibility by 16 known), so that rows load as vectors.
    @triton.jit(do_not_specialize=["rows"])
    def _quantize_rows(
        x_ptr, stride, values_ptr, scales_ptr, rows, cols,
        GELU: tl.constexpr, GELU_FORM: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
        HEAD: tl.constexpr, TAIL: tl.constexpr, ROWS: tl.constexpr,
    ):
        # ROWS whole rows per program, each held as two blocks (`row_blocks`): each row is
        # read once, and its largest magnitude sets its scale. Rows past `rows` are
        # padding: zeros, scale 1.
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        real = row[:, None] < rows
        head = tl.arange(0, HEAD)[None, :]
        tail = HEAD + tl.arange(0, TAIL)[None, :]
        read = row[:, None].to(tl.int64) * stride
        x = tl.load(x_ptr + read + head, mask=real, other=0.0).to(tl.float32)
        y = tl.load(x_ptr + read + tail, mask=real & (tail < cols), other=0.0).to(tl.float32)
        if GELU:  # GELU(0) = 0 keeps the padding zero
            x, y = _gelu(x, GELU_FORM), _gelu(y, GELU_FORM)
        largest = tl.maximum(tl.max(tl.abs(x), axis=1), tl.max(tl.abs(y), axis=1))
        scale = tl.maximum(largest / FP8_MAX, MIN_SCALE)
        scale = tl.where(row < rows, scale, 1.0)
        tl.store(scales_ptr + row, scale)
        reciprocal = tl.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)[:, None]
        written = row[:, None].to(tl.int64) * cols
        tl.store(values_ptr + written + head, (x * reciprocal).to(tl.float8e4nv))
        tl.store(values_ptr + written + tail, (y * reciprocal).to(tl.float8e4nv), mask=tail < cols)

    @triton.jit(do_not_specialize=["rows"])
    def _norm_quantize_rows(
        x_ptr, residual_ptr, total_ptr, weight_ptr, bias_ptr, values_ptr, scales_ptr, rows, cols, eps,
        ADD: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):
        # As `_quantize_rows`, over the layer norm of x (+ residual). The sum and the norm's
        # output are rounded to x's dtype where PyTorch's addition and layer norm round
        # them, so the product reads the values the unfused layers would have handed it.
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        column = tl.arange(0, BLOCK)
        real = row < rows
        inside = real[:, None] & (column < cols)[None, :]
        offsets = row[:, None].to(tl.int64) * cols + column[None, :]
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0)
        if ADD:
            x = (x.to(tl.float32) + tl.load(residual_ptr + offsets, mask=inside, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(total_ptr + offsets, x, mask=inside)
        dtype = x.dtype
        x = x.to(tl.float32)
        mean = tl.sum(x, axis=1) / cols
        centred = tl.where(inside, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / cols + eps)
        weight = tl.load(weight_ptr + column, mask=column < cols, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + column, mask=column < cols, other=0.0).to(tl.float32)
        y = (centred * rstd[:, None] * weight[None, :] + bias[None, :]).to(dtype).to(tl.float32)
        y = tl.where(real[:, None], y, 0.0)
        scale = tl.maximum(tl.max(tl.abs(y), axis=1) / FP8_MAX, MIN_SCALE)
        scale = tl.where(real, scale, 1.0)
        tl.store(scales_ptr + row, scale)
        reciprocal = tl.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)
        tl.store(values_ptr + offsets, (y * reciprocal[:, None]).to(tl.float8e4nv), mask=(column < cols)[None, :])
