"""BlurPool: low-pass filter before every strided downsampling, so it aliases less (Zhang, 2019).

Surgery at ``Event.INIT``: strided 2-D ``nnx.Conv`` modules become :class:`BlurConv` (a fixed
``[1, 2, 1] x [1, 2, 1] / 16`` depthwise blur before or after the convolution, which keeps its kernel
and bias), and :class:`MaxPool` modules become :class:`BlurMaxPool`.

Flax NNX has no max-pooling *module*: ``nnx.max_pool`` is a function, and a model that calls it is
left as is (surgery can only swap modules). :class:`MaxPool` is a thin module around
``nnx.max_pool`` for models that want their pooling to be replaceable; a model can also use
:class:`BlurMaxPool` directly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models.surgery import replace_modules

__all__ = ["BlurConv", "BlurMaxPool", "BlurPool", "MaxPool", "apply_blurpool", "blur_2d", "blur_filter"]


def blur_filter(channels: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The depthwise ``(3, 3, 1, channels)`` HWIO kernel ``outer([1, 2, 1], [1, 2, 1]) / 16``.

    Example:
        >>> (blur_filter(2)[:, :, 0, 1] * 16).astype(int).tolist()
        [[1, 2, 1], [2, 4, 2], [1, 2, 1]]
    """
    taps = jnp.array([1.0, 2.0, 1.0], dtype)
    kernel = jnp.outer(taps, taps) / 16
    return jnp.broadcast_to(kernel[:, :, None, None], (3, 3, 1, channels))


def blur_2d(x: jax.Array, stride: int | Sequence[int] = 1) -> jax.Array:
    """Blur each channel of channels-last images ``(..., H, W, C)`` (one zero pixel of padding), then subsample.

    Leading dimensions before ``(H, W, C)`` are treated as batch dimensions. The padding is one
    pixel on every side, as Composer's: with ``stride=2`` output ``i`` is centred on input ``2 i``,
    the grid of the strided conv or pool it replaces (``'SAME'`` padding would pad ``(0, 1)`` on
    even sizes and centre on ``2 i + 1``). The output size is ``ceil(size / stride)`` either way.

    Example:
        >>> delta = jnp.zeros((1, 5, 5, 1)).at[0, 2, 2, 0].set(1.0)
        >>> (blur_2d(delta)[0, 1:4, 1:4, 0] * 16).astype(int).tolist()
        [[1, 2, 1], [2, 4, 2], [1, 2, 1]]
    """
    if x.ndim < 3:
        raise ValueError(f"blur_2d: expected channels-last images (..., H, W, C); got shape {x.shape}")
    strides = _pair(stride)
    batch_shape, image_shape = x.shape[:-3], x.shape[-3:]
    images = x.reshape((-1, *image_shape))
    channels = image_shape[-1]
    blurred = jax.lax.conv_general_dilated(
        images,
        blur_filter(channels, images.dtype),
        window_strides=strides,
        padding=((1, 1), (1, 1)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=channels,
    )
    return blurred.reshape((*batch_shape, *blurred.shape[1:]))


class BlurConv(nnx.Module):
    """A strided ``nnx.Conv`` with an anti-aliasing blur; the conv keeps its kernel and bias.

    ``blur_first=True``: ``conv(blur_2d(x))`` (the conv keeps its stride; the only extra cost is the
    blur). ``blur_first=False``: the conv runs with stride 1 and ``blur_2d(conv(x), stride)``
    subsamples, as in the paper (the conv then costs ``stride**2`` times more).
    Either way the output shape is the original conv's.

    Args:
        conv: a 2-D ``nnx.Conv`` (channels-last inputs).
        blur_first: blur the input before the conv (True) or blur-and-subsample its output (False).
    """

    def __init__(self, conv: nnx.Conv, blur_first: bool = True) -> None:
        if len(conv.kernel_size) != 2:
            raise ValueError(f"BlurConv: expected a 2-D conv; got kernel_size={conv.kernel_size}")
        self.stride = _pair(conv.strides)
        self.blur_first = blur_first
        if not blur_first:
            conv.strides = 1  # the conv runs densely; the blur subsamples
        self.conv = conv

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.blur_first:
            return self.conv(blur_2d(x))
        return blur_2d(self.conv(x), self.stride)


class MaxPool(nnx.Module):
    """``nnx.max_pool`` as a module, so that surgery (BlurPool) can find and replace it.

    Example:
        >>> MaxPool((2, 2))(jnp.arange(16.0).reshape(1, 4, 4, 1))[0, :, :, 0].tolist()
        [[5.0, 7.0], [13.0, 15.0]]
    """

    def __init__(self, window_shape: Sequence[int] = (2, 2), strides: Sequence[int] | None = None,
                 padding: str = "VALID") -> None:
        self.window_shape = tuple(window_shape)
        self.strides = tuple(strides) if strides is not None else self.window_shape
        self.padding = padding

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.max_pool(x, self.window_shape, self.strides, self.padding)


class BlurMaxPool(nnx.Module):
    """Anti-aliased max pooling: max pool with stride 1, then ``blur_2d`` with the pooling stride.

    The output shape is that of ``MaxPool(window_shape, strides, padding)``.
    """

    def __init__(self, window_shape: Sequence[int] = (2, 2), strides: Sequence[int] | None = None,
                 padding: str = "VALID") -> None:
        self.window_shape = tuple(window_shape)
        self.strides = tuple(strides) if strides is not None else self.window_shape
        self.padding = padding

    def __call__(self, x: jax.Array) -> jax.Array:
        dense = nnx.max_pool(x, self.window_shape, (1,) * len(self.window_shape), self.padding)
        return blur_2d(dense, self.strides)


def apply_blurpool(model: nnx.Module, replace_convs: bool = True, replace_maxpools: bool = True,
                   blur_first: bool = True, min_channels: int = 16) -> int:
    """Add blur filters to the strided convs and max pools of ``model`` in place; return how many.

    A conv is replaced when it is a 2-D ``nnx.Conv`` with a stride above 1 on some axis and
    ``in_features >= min_channels`` (skipping the stem of most networks). Modules already blurred
    are left alone, so applying twice changes nothing.

    Example:
        >>> from composerjax.models import SmallResNet
        >>> apply_blurpool(SmallResNet(width=4, rngs=nnx.Rngs(0)), min_channels=4)
        2
    """
    _check_arguments(replace_convs, replace_maxpools, blur_first, min_channels)
    already_wrapped = {id(module.conv) for _, module in nnx.iter_modules(model) if isinstance(module, BlurConv)}
    replaced = 0

    def blur_conv(conv: nnx.Conv) -> nnx.Module:
        nonlocal replaced
        eligible = (len(conv.kernel_size) == 2 and max(_pair(conv.strides)) > 1
                    and conv.in_features >= min_channels and id(conv) not in already_wrapped)
        if not eligible:
            return conv
        replaced += 1
        return BlurConv(conv, blur_first)

    def blur_max_pool(pool: MaxPool) -> nnx.Module:
        nonlocal replaced
        replaced += 1
        return BlurMaxPool(pool.window_shape, pool.strides, pool.padding)

    policies: dict[type, Callable[..., nnx.Module]] = {}
    if replace_convs:
        policies[nnx.Conv] = blur_conv
    if replace_maxpools:
        policies[MaxPool] = blur_max_pool
    replace_modules(model, policies)
    return replaced


class BlurPool(Algorithm):
    """Blur before strided convs and max pools (anti-aliasing), by model surgery at ``Event.INIT``.

    Args:
        replace_convs: replace strided 2-D ``nnx.Conv`` modules with :class:`BlurConv`.
        replace_maxpools: replace :class:`MaxPool` modules with :class:`BlurMaxPool` (a model that
            calls the ``nnx.max_pool`` function has nothing to replace).
        blur_first: blur before the conv (cheap) rather than after a stride-1 conv (as in the paper).
        min_channels: leave convs with fewer input channels than this alone.

    Example::

        trainer = Trainer(ComposerClassifier(SmallResNet(rngs=nnx.Rngs(0)), 10), loader, '1ep',
                          algorithms=[BlurPool(min_channels=16)])
    """

    required_modules = (nnx.Conv,)

    def __init__(self, replace_convs: bool = True, replace_maxpools: bool = True, blur_first: bool = True,
                 min_channels: int = 16) -> None:
        _check_arguments(replace_convs, replace_maxpools, blur_first, min_channels)
        self.replace_convs = replace_convs
        self.replace_maxpools = replace_maxpools
        self.blur_first = blur_first
        self.min_channels = min_channels

    events = frozenset({Event.INIT})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        replaced = apply_blurpool(state.model, self.replace_convs, self.replace_maxpools, self.blur_first,
                                  self.min_channels)
        logger.log_hyperparameters({"blurpool/num_replaced": replaced})
        if replaced == 0:
            warnings.warn(f"BlurPool replaced no modules: the model has no strided 2-D nnx.Conv with "
                          f"in_features >= min_channels={self.min_channels} and no MaxPool module",
                          stacklevel=2)

    def __repr__(self) -> str:
        return (f"BlurPool(replace_convs={self.replace_convs}, replace_maxpools={self.replace_maxpools}, "
                f"blur_first={self.blur_first}, min_channels={self.min_channels})")


def _pair(stride: int | Sequence[int] | None) -> tuple[int, int]:
    if stride is None:
        return (1, 1)
    if isinstance(stride, int):
        return (stride, stride)
    values = tuple(int(s) for s in stride)
    return (values[0], values[0]) if len(values) == 1 else values  # type: ignore[return-value]


def _check_arguments(replace_convs: bool, replace_maxpools: bool, blur_first: bool, min_channels: int) -> None:
    for name, value in (("replace_convs", replace_convs), ("replace_maxpools", replace_maxpools),
                        ("blur_first", blur_first)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: expected True or False")
    if isinstance(min_channels, bool) or not isinstance(min_channels, int) or min_channels < 0:
        raise ValueError(f"min_channels={min_channels!r}: expected an integer >= 0")
