"""deep_ep.validation through ElasticBuffer: every bad argument raises TypeError/ValueError naming it.

Runs in-process on a one-rank gloo group (validation never communicates, so one rank sees it all).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.utils.fp8 import per_token_cast_to_fp8
from deep_ep.utils.routing import uniform_routing

E, K, H, T, TMAX = 8, 2, 256, 6, 16


@pytest.fixture(scope="module")
def buffer(group: dist.ProcessGroup) -> deep_ep.ElasticBuffer:
    return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TMAX, hidden=H, num_topk=4, backend="reference")


@pytest.fixture
def inputs() -> dict[str, Any]:
    seed = random.SystemRandom().randrange(1 << 30)
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    topk_idx, topk_weights = uniform_routing(T, E, K, generator=gen)
    x = torch.randn((T, H), generator=gen).to(torch.bfloat16)
    return {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "num_experts": E}


def raises(error: type[Exception], name: str, fn: Any, *args: Any, **kwargs: Any) -> str:
    """Call `fn`, expect `error` whose message names `name` in backticks; return the message."""
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert f"`{name}`" in message, f"message does not name `{name}`: {message}"
    return message


def test_dtype_message_names_expected_and_actual(buffer: deep_ep.ElasticBuffer, inputs: dict[str, Any]) -> None:
    inputs["topk_idx"] = inputs["topk_idx"].to(torch.int32)
    message = raises(TypeError, "topk_idx", buffer.dispatch, **inputs)
    assert message == "dispatch: `topk_idx` must have dtype torch.int64, got torch.int32"


@pytest.mark.parametrize(
    "name,error,make",
    [
        ("x", TypeError, lambda i: 3),
        ("x", TypeError, lambda i: i["x"].bool()),
        ("x", ValueError, lambda i: i["x"][0]),
        ("x", ValueError, lambda i: i["x"].repeat(1, 2)[:, ::2]),
        ("x", ValueError, lambda i: torch.ones((T, H + 64), dtype=torch.bfloat16)),
        ("x", ValueError, lambda i: torch.ones((T, 4), dtype=torch.bfloat16)),
        ("x", ValueError, lambda i: i["x"].to("meta")),
        ("x", TypeError, lambda i: (*per_token_cast_to_fp8(i["x"]), None)),
        ("x[0]", TypeError, lambda i: (i["x"].bool(), per_token_cast_to_fp8(i["x"])[1])),
        ("x[1]", TypeError, lambda i: (per_token_cast_to_fp8(i["x"])[0], per_token_cast_to_fp8(i["x"])[1].double())),
        ("x[1]", ValueError, lambda i: (per_token_cast_to_fp8(i["x"])[0], torch.ones((T, 0)))),
        ("x[1]", ValueError, lambda i: (per_token_cast_to_fp8(i["x"])[0], torch.ones((T + 1, 2)))),
    ],
)
def test_bad_x(buffer: deep_ep.ElasticBuffer, inputs: dict[str, Any], name: str, error: type, make: Any) -> None:
    inputs["x"] = make(inputs)
    raises(error, name, buffer.dispatch, **inputs)


@pytest.mark.parametrize(
    "name,error,update",
    [
        ("topk_idx", ValueError, lambda i: {"topk_idx": None}),
        ("topk_idx", ValueError, lambda i: {"topk_idx": i["topk_idx"][:-1]}),
        ("topk_idx", ValueError, lambda i: {"topk_idx": i["topk_idx"][:, :0]}),
        ("topk_idx", ValueError, lambda i: {"topk_idx": torch.zeros((T, 5), dtype=torch.int64)}),
        ("topk_idx", ValueError, lambda i: {"topk_idx": i["topk_idx"].t().contiguous().t()}),
        ("topk_idx", ValueError, lambda i: {"topk_idx": i["topk_idx"].index_fill(1, torch.tensor([1]), E)}),
        ("topk_idx", ValueError, lambda i: {"topk_idx": i["topk_idx"].index_fill(1, torch.tensor([0]), -2)}),
        ("topk_idx", ValueError, lambda i: {"topk_idx": i["topk_idx"][:, :1].repeat(1, 2)}),
        ("topk_weights", TypeError, lambda i: {"topk_weights": i["topk_weights"].double()}),
        ("topk_weights", ValueError, lambda i: {"topk_weights": i["topk_weights"][:, :1]}),
        ("topk_weights", TypeError, lambda i: {"topk_weights": [1.0]}),
        ("num_experts", ValueError, lambda i: {"num_experts": None}),
        ("num_experts", TypeError, lambda i: {"num_experts": 8.0}),
        ("num_experts", ValueError, lambda i: {"num_experts": 0}),
        ("num_max_tokens_per_rank", ValueError, lambda i: {"num_max_tokens_per_rank": T - 1}),
        ("num_max_tokens_per_rank", ValueError, lambda i: {"num_max_tokens_per_rank": 0}),
        ("expert_alignment", ValueError, lambda i: {"expert_alignment": 0}),
        (
            "cumulative_local_expert_recv_stats",
            TypeError,
            lambda i: {"cumulative_local_expert_recv_stats": torch.zeros(E, dtype=torch.int64)},
        ),
        (
            "cumulative_local_expert_recv_stats",
            ValueError,
            lambda i: {"cumulative_local_expert_recv_stats": torch.zeros(E - 1, dtype=torch.int32)},
        ),
        ("do_zero_padding", ValueError, lambda i: {"do_zero_padding": True}),
        ("do_expand", TypeError, lambda i: {"do_expand": "yes"}),
        ("do_cpu_sync", TypeError, lambda i: {"do_cpu_sync": 2}),
        ("previous_event", ValueError, lambda i: {"previous_event": deep_ep.ElasticBuffer.capture()}),
        ("previous_event", TypeError, lambda i: {"previous_event": object(), "allocate_on_comm_stream": True}),
        ("num_sms", ValueError, lambda i: {"num_sms": -1}),
        ("num_qps", ValueError, lambda i: {"num_qps": 10_000}),
        ("handle", TypeError, lambda i: {"topk_idx": None, "handle": "a handle"}),
    ],
)
def test_bad_dispatch_argument(
    buffer: deep_ep.ElasticBuffer, inputs: dict[str, Any], name: str, error: type, update: Any
) -> None:
    originals = {k: (v, v.clone()) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    inputs.update(update(inputs))
    raises(error, name, buffer.dispatch, **inputs)
    for k, (original, copy) in originals.items():
        assert torch.equal(original, copy), f"`{k}` was modified"


def test_host_value_checks_where_the_device_does_not_check_unless_told(monkeypatch: Any) -> None:
    from deep_ep.validation import host_checks_values

    monkeypatch.delenv("EP_CHECK_VALUES", raising=False)
    assert host_checks_values(device_checks_values=False) and not host_checks_values(device_checks_values=True)
    monkeypatch.setenv("EP_CHECK_VALUES", "1")
    assert host_checks_values(device_checks_values=False) and host_checks_values(device_checks_values=True)
    monkeypatch.setenv("EP_CHECK_VALUES", "0")
    assert not host_checks_values(device_checks_values=False) and not host_checks_values(device_checks_values=True)


def test_the_reference_backend_raises_a_bad_value_at_once_unless_checks_are_off(
    buffer: deep_ep.ElasticBuffer, inputs: dict[str, Any], monkeypatch: Any
) -> None:
    bad = dict(inputs, topk_idx=inputs["topk_idx"].clone())
    bad["topk_idx"][1, 0] = 10_000
    monkeypatch.delenv("EP_CHECK_VALUES", raising=False)
    raises(ValueError, "topk_idx", buffer.dispatch, **bad)


def test_buffer_without_default_max_tokens(group: dist.ProcessGroup, inputs: dict[str, Any]) -> None:
    buffer = deep_ep.ElasticBuffer(group, num_bytes=2 << 20, backend="reference")
    raises(ValueError, "num_max_tokens_per_rank", buffer.dispatch, **inputs)
    buffer.dispatch(**inputs, num_max_tokens_per_rank=T)


@pytest.mark.parametrize(
    "name,error,update",
    [
        ("topk_idx", ValueError, lambda i, h: {"topk_idx": i["topk_idx"]}),
        ("do_cpu_sync", ValueError, lambda i, h: {"do_cpu_sync": True}),
        ("do_expand", ValueError, lambda i, h: {"do_expand": True}),
        ("num_experts", ValueError, lambda i, h: {"num_experts": 2 * E}),
        ("expert_alignment", ValueError, lambda i, h: {"expert_alignment": 4}),
        ("num_max_tokens_per_rank", ValueError, lambda i, h: {"num_max_tokens_per_rank": TMAX + 1}),
        ("x", ValueError, lambda i, h: {"x": i["x"][:-1]}),
        ("topk_weights", ValueError, lambda i, h: {"topk_weights": i["topk_weights"][:-1]}),
    ],
)
def test_bad_cached_dispatch(
    buffer: deep_ep.ElasticBuffer, inputs: dict[str, Any], name: str, error: type, update: Any
) -> None:
    _, _, _, handle, _ = buffer.dispatch(**inputs)
    cached = {"x": inputs["x"], "handle": handle, "topk_weights": inputs["topk_weights"]}
    cached.update(update(inputs, handle))
    raises(error, name, buffer.dispatch, **cached)


def test_handle_from_another_buffer(
    group: dist.ProcessGroup, buffer: deep_ep.ElasticBuffer, inputs: dict[str, Any]
) -> None:
    other = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TMAX, hidden=H, backend="reference")
    recv_x, _, _, handle, _ = other.dispatch(**inputs)
    raises(ValueError, "handle", buffer.dispatch, inputs["x"], handle=handle)
    raises(ValueError, "handle", buffer.combine, recv_x, handle)


@pytest.mark.parametrize("do_expand", [False, True])
def test_bad_combine_argument(buffer: deep_ep.ElasticBuffer, inputs: dict[str, Any], do_expand: bool) -> None:
    recv_x, _, recv_weights, handle, _ = buffer.dispatch(**inputs, do_expand=do_expand, expert_alignment=4)
    rows = recv_x.shape[0]
    bias = torch.randn((T, H)).to(torch.bfloat16)
    raises(TypeError, "handle", buffer.combine, recv_x, None)
    raises(TypeError, "x", buffer.combine, recv_x.float(), handle)
    raises(ValueError, "x", buffer.combine, recv_x[:-1], handle)
    raises(ValueError, "x", buffer.combine, torch.ones((rows, H // 2 + 1), dtype=torch.bfloat16), handle)
    raises(ValueError, "x", buffer.combine, recv_x.to("meta"), handle)
    wrong_weights = torch.ones((rows, K)) if do_expand else torch.ones(rows)
    raises(ValueError, "topk_weights", buffer.combine, recv_x, handle, topk_weights=wrong_weights)
    raises(TypeError, "topk_weights", buffer.combine, recv_x, handle, topk_weights=recv_weights.double())
    raises(ValueError, "bias", buffer.combine, recv_x, handle, bias=bias[:-1])
    raises(TypeError, "bias", buffer.combine, recv_x, handle, bias=bias.float())
    raises(TypeError, "bias", buffer.combine, recv_x, handle, bias=(bias, bias, bias))
    raises(TypeError, "bias", buffer.combine, recv_x, handle, bias="bias")
    raises(ValueError, "bias[1]", buffer.combine, recv_x, handle, bias=(bias, bias[:, :128]))
    raises(TypeError, "bias[0]", buffer.combine, recv_x, handle, bias=(None, bias))
    raises(ValueError, "previous_event", buffer.combine, recv_x, handle, previous_event=buffer.capture())
    raises(ValueError, "num_qps", buffer.combine, recv_x, handle, num_qps=10_000)
    raises(TypeError, "async_with_compute_stream", buffer.combine, recv_x, handle, async_with_compute_stream=None)


def test_handle_of_the_other_mode(buffer: deep_ep.ElasticBuffer, inputs: dict[str, Any]) -> None:
    # Alignment 128 makes the expanded row count differ from the plain one
    plain_x, _, _, plain, _ = buffer.dispatch(**inputs, expert_alignment=128)
    expanded_x, _, _, expanded, _ = buffer.dispatch(**inputs, expert_alignment=128, do_expand=True)
    assert plain_x.shape[0] != expanded_x.shape[0]
    raises(ValueError, "x", buffer.combine, plain_x, expanded)
    raises(ValueError, "x", buffer.combine, expanded_x, plain)
    raises(ValueError, "do_expand", buffer.dispatch, inputs["x"], handle=plain, do_expand=True)


def test_constructor_arguments(group: dist.ProcessGroup) -> None:
    raises(TypeError, "group", deep_ep.ElasticBuffer, "world")
    raises(ValueError, "num_bytes", deep_ep.ElasticBuffer, group, num_bytes=12345, backend="reference")
    raises(ValueError, "num_max_tokens_per_rank", deep_ep.ElasticBuffer, group, backend="reference")
    raises(ValueError, "backend", deep_ep.ElasticBuffer, group, 2 << 20, backend="fastest")
    raises(
        ValueError,
        "num_cpu_timeout_secs",
        deep_ep.ElasticBuffer,
        group,
        2 << 20,
        num_cpu_timeout_secs=0,
        backend="reference",
    )
    raises(
        ValueError, "num_cpu_bytes", deep_ep.ElasticBuffer, group, 2 << 20, num_cpu_bytes=2 << 20, backend="reference"
    )
    raises(TypeError, "deterministic", deep_ep.ElasticBuffer, group, 2 << 20, deterministic="no", backend="reference")
    # A CPU group never gets the kernel backend
    raises(ValueError, "backend", deep_ep.ElasticBuffer, group, 2 << 20, backend="kernels")


def test_destroyed_buffer(group: dist.ProcessGroup, inputs: dict[str, Any]) -> None:
    buffer = deep_ep.ElasticBuffer(
        group, 2 << 20, num_max_tokens_per_rank=TMAX, explicitly_destroy=True, backend="reference"
    )
    recv_x, _, _, handle, _ = buffer.dispatch(**inputs)
    buffer.destroy()
    buffer.destroy()
    with pytest.raises(ValueError, match="destroyed"):
        buffer.dispatch(**inputs)
    with pytest.raises(ValueError, match="destroyed"):
        buffer.combine(recv_x, handle)
    with pytest.raises(ValueError, match="destroyed"):
        buffer.barrier()
    implicit = deep_ep.ElasticBuffer(group, 2 << 20, backend="reference")
    raises(ValueError, "explicitly_destroy", implicit.destroy)
