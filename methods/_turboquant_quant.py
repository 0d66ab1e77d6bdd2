"""TurboQuant's quantizer (methods/turboquant.py): Lloyd-Max codebooks for a rotated unit
vector's coordinates, the seeded rotation and QJL projection, the outlier-channel split, and the
per-token bit layout of the codes.

Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate", arXiv 2504.19874:
  * TurboQuant_mse (Algorithm 1): y = Pi x for a unit vector x and a random rotation Pi; every
    coordinate of y has the density of one coordinate of a uniform point on the sphere S^{d-1},
        f_d(x) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) (1 - x^2)^((d-3)/2),   x in [-1, 1],
    and is rounded to the nearest of the 2^b Lloyd-Max centroids of f_d (`lloyd_max`);
    dequantization is Pi^T c[idx].
  * TurboQuant_prod (Algorithm 2): TurboQuant_mse at b - 1 bits, then the residual
    r = x - x_mse by QJL: signs sign(S r) with S a d x d matrix of i.i.d. N(0, 1) entries and
    gamma = |r|; dequantization adds sqrt(pi/2) / d * gamma * S^T signs. For every y,
    E_S <y, x_prod> = <y, x> (unbiased inner products; Lemma 4 of QJL, arXiv 2406.03482).
  * Non-unit vectors: the norm is stored and the unit direction quantized (paper §2).
  * Outlier channels (paper §4.3, the KV-cache experiments): the channels are split into an
    outlier set and the rest, and two independent TurboQuant instances (each its own rotation,
    QJL matrix, codebook and norms) quantize them, the outliers at more bits; the average is the
    fractional bit width. How the outlier channels are found is not specified there; we take
    the rule of the authors' QJL code (`QJLKeyQuantizer.build_sketch`): per block of tokens and
    KV head, the channels with the largest L2 norm over the block's tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

LLOYD_GRID = 1 << 16  # quadrature points on [-pi/2, pi/2] for the codebooks
LLOYD_ITERS = 2000
QJL_SCALE = math.sqrt(math.pi / 2)  # times gamma / d: makes E[S^T sign(S r)] scale back to r


# --------------------------------------------------------------------------------------------
# codebooks
def coordinate_density(x: torch.Tensor, d: int) -> torch.Tensor:
    """f_d(x): the density of one coordinate of a uniform point on S^{d-1} (d >= 2)."""
    log_c = math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2)
    return torch.exp(log_c + (d - 3) / 2 * torch.log1p(-x * x))


@functools.lru_cache(maxsize=64)
def lloyd_max(d: int, bits: int) -> torch.Tensor:
    """The 2^bits MSE-optimal centroids (ascending, fp64) for a coordinate of density f_d.

    Lloyd's iteration (boundaries at the midpoints, each centroid the conditional mean of its
    cell) on a quadrature in phi, x = sin(phi): there f_d(x) dx is proportional to
    cos(phi)^(d - 2) dphi, smooth on [-pi/2, pi/2] for every d >= 2 (no endpoint singularity).
    Started from the quantiles; stops when no centroid moves by 1e-13 (fp64)."""
    if d < 2 or bits < 1:
        raise ValueError(f"lloyd_max needs d >= 2 and bits >= 1 (got d={d}, bits={bits})")
    # the density has width ~ 1 / sqrt(d): the grid spans 16 widths (the rest has mass < 1e-50)
    span = min(math.pi / 2, 16 / math.sqrt(max(d - 2, 1)))
    phi = ((torch.arange(LLOYD_GRID + 1, dtype=torch.float64) / LLOYD_GRID) * 2 - 1) * span
    x = torch.sin(phi)
    # cumulative mass and first moment at the grid edges (midpoint rule per interval), read at
    # any boundary by linear interpolation: cells move continuously (no stall on grid points)
    mid = (phi[1:] + phi[:-1]) / 2
    w = torch.cos(mid) ** (d - 2)
    w = w / w.sum()
    mass = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(w, 0)])
    moment = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(w * torch.sin(mid), 0)])
    k = 1 << bits
    c = _interp((torch.arange(k, dtype=torch.float64) + 0.5) / k, mass, x)
    for _ in range(LLOYD_ITERS):
        edges = torch.cat([x[:1], (c[1:] + c[:-1]) / 2, x[-1:]])
        at = torch.asin(edges.clamp(-1, 1))
        m, f = _interp(at, phi, mass), _interp(at, phi, moment)
        new = (f[1:] - f[:-1]) / (m[1:] - m[:-1])
        done = (new - c).abs().max() < 1e-13
        c = new
        if done:
            break
    return (c - c.flip(0)) / 2  # exactly symmetric (the density is even)


def _interp(at: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """ys linearly interpolated at `at` (xs ascending; clamped to its ends)."""
    i = torch.searchsorted(xs, at).clamp(1, xs.numel() - 1)
    x0, x1 = xs[i - 1], xs[i]
    t = ((at - x0) / (x1 - x0)).clamp(0, 1)
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


def midpoints(codebook: torch.Tensor) -> torch.Tensor:
    return (codebook[1:] + codebook[:-1]) / 2


# --------------------------------------------------------------------------------------------
# random matrices
def random_rotation(d: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-random d x d orthogonal matrix (QR of a Gaussian matrix, signs fixed), fp64."""
    g = torch.randn(d, d, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return q * torch.sign(torch.diagonal(r))[None, :]


def gaussian_projection(d: int, generator: torch.Generator) -> torch.Tensor:
    """QJL's S: d x d i.i.d. N(0, 1), fp64."""
    return torch.randn(d, d, generator=generator, dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# one quantizer: the channel split and each part's TurboQuant instance
@dataclass(frozen=True)
class Part:
    """One TurboQuant instance over `dim` channels: `mse_bits` per coordinate of Lloyd-Max
    codes, plus one QJL sign bit per coordinate when `qjl`."""

    dim: int
    mse_bits: int
    qjl: bool
    rotation: torch.Tensor  # (dim, dim) fp32, Pi
    projection: torch.Tensor | None  # (dim, dim) fp32, S (qjl only)
    codebook: torch.Tensor  # (2^mse_bits,) fp32

    @property
    def bits(self) -> int:
        return self.mse_bits + int(self.qjl)

    @property
    def qjl_coef(self) -> float:
        return QJL_SCALE / self.dim


@dataclass(frozen=True)
class Quantizer:
    """One tensor's quantizer (keys or values) for head_dim D: `parts` = (outlier part, regular
    part) or (regular part,) without a split; every block of `block_tokens` tokens of a head
    chooses its own outlier channels."""

    head_dim: int
    parts: tuple[Part, ...]
    block_tokens: int

    @property
    def split(self) -> bool:
        return len(self.parts) == 2

    @property
    def outlier_channels(self) -> int:
        return self.parts[0].dim if self.split else 0

    @property
    def qjl(self) -> bool:
        return self.parts[0].qjl

    def code_bits(self) -> int:
        return sum(p.dim * p.mse_bits for p in self.parts)

    def code_bytes(self) -> int:
        """Bytes of one token's MSE codes (all parts in one bit stream, padded to a byte)."""
        return -(-self.code_bits() // 8)

    def sign_bytes(self) -> int:
        return -(-self.head_dim // 8) if self.qjl else 0

    def mask_bytes(self) -> int:
        return -(-self.head_dim // 8) if self.split else 0

    def bits_per_coordinate(self) -> float:
        """Codes and signs only, as the paper counts ("2.5 bits")."""
        return sum(p.dim * p.bits for p in self.parts) / self.head_dim

    def token_bytes(self) -> int:
        """One token's bytes per head: codes, signs, fp16 norms (and fp16 residual norms)."""
        norms = 2 * len(self.parts) * (2 if self.qjl else 1)
        return self.code_bytes() + self.sign_bytes() + norms

    def widths(self) -> torch.Tensor:
        """MSE bits of each coordinate in stream order `(D,)` (outlier part first)."""
        return torch.cat([torch.full((p.dim,), p.mse_bits) for p in self.parts])

    def block_diagonal(self, which: str) -> torch.Tensor:
        """diag(rotation of each part) or diag(coef * projection) `(D, D)` fp32, in stream order
        (the kernels rotate a permuted query with it)."""
        out = torch.zeros(self.head_dim, self.head_dim)
        i = 0
        for p in self.parts:
            m = p.rotation if which == "rotation" else p.projection * p.qjl_coef
            out[i:i + p.dim, i:i + p.dim] = m
            i += p.dim
        return out

    @functools.cached_property
    def kernel_constants(self) -> dict[str, torch.Tensor]:
        """What the kernels read, built once (CPU, contiguous): block-diagonal rotation and
        scaled projection `(D, D)`, both also transposed (`*_t`: the C kernel rotates a query
        column by column, contiguous), the codebooks, and per coordinate in stream order its bit
        offset, width, codebook base and part (`layout`, int32 `(4, D)`)."""
        widths = self.widths()
        parts = torch.cat([torch.full((p.dim,), i) for i, p in enumerate(self.parts)])
        layout = torch.stack([torch.cumsum(widths, 0) - widths, widths,
                              torch.tensor(self.offsets())[parts], parts])
        rotation = self.block_diagonal("rotation")
        projection = self.block_diagonal("projection") if self.qjl else rotation
        return {"rotation": rotation.contiguous(), "projection": projection.contiguous(),
                "rotation_t": rotation.T.contiguous(), "projection_t": projection.T.contiguous(),
                "codebooks": self.codebooks().contiguous(),
                "layout": layout.to(torch.int32).contiguous()}

    def codebooks(self) -> torch.Tensor:
        """The parts' codebooks concatenated (a coordinate of part i indexes from offsets()[i])."""
        return torch.cat([p.codebook for p in self.parts])

    def offsets(self) -> list[int]:
        out, at = [], 0
        for p in self.parts:
            out.append(at)
            at += p.codebook.numel()
        return out


def build_quantizer(head_dim: int, bits: float, outlier_ratio: float, qjl: bool,
                    block_tokens: int, generator: torch.Generator) -> Quantizer:
    """The quantizer for `bits` per coordinate (codes + QJL signs): an integer width quantizes all
    channels alike; a fractional one splits off `outlier_ratio` of the channels, which get the
    bits that make the average exactly `bits` (`split_widths`)."""
    dims = split_widths(head_dim, bits, outlier_ratio)
    parts = []
    for dim, width in dims:
        mse = width - int(qjl)
        parts.append(Part(dim, mse, qjl, random_rotation(dim, generator).float(),
                          gaussian_projection(dim, generator).float() if qjl else None,
                          lloyd_max(dim, mse).float()))
    return Quantizer(head_dim, tuple(parts), block_tokens)


def split_widths(head_dim: int, bits: float, outlier_ratio: float) -> list[tuple[int, int]]:
    """[(channels, bits)] per part: [(D, b)] for an integer b; for b = n + f (0 < f < 1),
    outliers = outlier_ratio * D channels at n + f / outlier_ratio bits, the rest at n, so the
    average is exactly b (ValueError when that is not whole channels / whole bits)."""
    base = math.floor(bits)
    frac = bits - base
    if frac == 0:
        return [(head_dim, base)]
    outliers = outlier_ratio * head_dim
    extra = frac / outlier_ratio
    if abs(outliers - round(outliers)) > 1e-9 or not 0 < round(outliers) < head_dim:
        raise ValueError(f"outlier_ratio={outlier_ratio} of head_dim={head_dim} is not a whole "
                         "number of channels between 1 and head_dim - 1")
    if abs(extra - round(extra)) > 1e-9:
        raise ValueError(f"bits={bits} with outlier_ratio={outlier_ratio}: the outliers would need "
                         f"{base + extra:g} bits (not whole)")
    return [(round(outliers), base + round(extra)), (head_dim - round(outliers), base)]


# --------------------------------------------------------------------------------------------
# quantize / dequantize one block of tokens
def outlier_permutation(x: torch.Tensor, q: Quantizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head of a block `x (H, n, D)`: the outlier mask `(H, D)` bool (the outlier_channels
    channels of largest L2 norm over the block's tokens; all False without a split) and the
    stream order `(H, D)` int64 (outlier channels ascending, then the rest ascending)."""
    h, _, d = x.shape
    mask = torch.zeros(h, d, dtype=torch.bool, device=x.device)
    if q.split:
        top = x.float().norm(dim=1).topk(q.outlier_channels, dim=-1).indices
        mask.scatter_(1, top, True)
    return mask, permutation(mask)


def permutation(mask: torch.Tensor) -> torch.Tensor:
    """Stream order from an outlier mask `(..., D)`: outlier channels ascending, then the rest."""
    d = mask.shape[-1]
    key = (~mask).long() * d + torch.arange(d, device=mask.device)
    return key.argsort(dim=-1)


def quantize_block(x: torch.Tensor, q: Quantizer) -> dict[str, torch.Tensor]:
    """Quantize `x (H, n, D)` (one block of n tokens): codes `(H, n, code_bytes)` uint8, signs
    `(H, n, sign_bytes)` uint8 (QJL only), norms / residual norms `(H, n, parts)` fp16, mask
    `(H, D)` bool."""
    mask, perm = outlier_permutation(x, q)
    xp = torch.gather(x.float(), 2, perm[:, None, :].expand_as(x))  # stream order
    codes, signs, norms, rnorms, i = [], [], [], [], 0
    for p in q.parts:
        xs = xp[..., i:i + p.dim]
        i += p.dim
        norm = xs.norm(dim=-1, keepdim=True)
        unit = xs / torch.where(norm > 0, norm, torch.ones_like(norm))
        idx = torch.bucketize((unit @ p.rotation.T).contiguous(), midpoints(p.codebook))
        codes.append(idx)
        norms.append(norm)
        if p.qjl:
            residual = unit - p.codebook[idx] @ p.rotation
            signs.append((residual @ p.projection.T) >= 0)
            rnorms.append(norm * residual.norm(dim=-1, keepdim=True))
    out = {"codes": pack_stream(torch.cat(codes, -1), q.widths()),
           "norms": torch.cat(norms, -1).half(), "mask": mask}
    if q.qjl:
        out["signs"] = pack_stream(torch.cat(signs, -1).long(), torch.ones(q.head_dim, dtype=torch.long))
        out["rnorms"] = torch.cat(rnorms, -1).half()
    return out


def dequantize(codes, signs, norms, rnorms, perm, q: Quantizer) -> torch.Tensor:
    """Tokens `(H, n, D)` fp32 back from their codes; `perm (H, n, D)` each token's stream order.
    With QJL this is the estimate whose inner products are unbiased."""
    idx = unpack_stream(codes, q.widths())
    sgn = None if signs is None else unpack_stream(signs, torch.ones(q.head_dim, dtype=torch.long))
    out, i = [], 0
    for j, p in enumerate(q.parts):
        y = p.codebook.to(codes.device)[idx[..., i:i + p.dim]]
        v = norms[..., j:j + 1].float() * (y @ p.rotation.to(codes.device))
        if p.qjl:
            s = sgn[..., i:i + p.dim].float() * 2 - 1
            v = v + rnorms[..., j:j + 1].float() * p.qjl_coef * (s @ p.projection.to(codes.device))
        out.append(v)
        i += p.dim
    streamed = torch.cat(out, -1)
    return torch.zeros_like(streamed).scatter_(-1, perm, streamed)


# --------------------------------------------------------------------------------------------
# the per-token bit stream: coordinate j takes widths[j] bits, little-endian, padded to a byte
def pack_stream(codes: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """(..., N) codes, code j < 2^widths[j] -> (..., ceil(sum(widths) / 8)) uint8."""
    bits = _bit_planes(codes, widths)  # (..., total)
    pad = (-bits.shape[-1]) % 8
    bits = torch.nn.functional.pad(bits, (0, pad)).unflatten(-1, (-1, 8))
    weights = (1 << torch.arange(8, device=codes.device)).to(torch.int64)
    return (bits * weights).sum(-1).to(torch.uint8)


def unpack_stream(packed: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_stream: -> (..., N) int64."""
    shifts = torch.arange(8, device=packed.device)
    bits = ((packed.long()[..., None] >> shifts) & 1).flatten(-2)  # (..., bytes * 8)
    widths = widths.to(packed.device)
    starts = torch.cumsum(widths, 0) - widths
    out = torch.zeros(*packed.shape[:-1], widths.numel(), dtype=torch.long, device=packed.device)
    for b in range(int(widths.max())):
        live = widths > b
        pos = (starts + b).clamp(max=bits.shape[-1] - 1)
        out += torch.where(live, bits[..., pos] << b, 0)
    return out


def _bit_planes(codes: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    widths = widths.to(codes.device)
    top = int(widths.max())
    planes = (codes.long()[..., None] >> torch.arange(top, device=codes.device)) & 1  # (..., N, top)
    keep = torch.arange(top, device=codes.device)[None, :] < widths[:, None]  # (N, top)
    return planes[..., keep]  # (..., sum(widths)) in stream order
