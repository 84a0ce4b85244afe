"""The chart's ``dtype`` of target and draft, the draft's ``device`` and the target's ``compile``: they
reach the services' flags, and the values schema and templates refuse what the services would."""

from __future__ import annotations

import helm_python as helm
import pytest
from test_helm_chart import CHART, NAMESPACE, RELEASE, container, render, role_workload

from specdec.cli import _parser


@pytest.fixture(scope="module")
def chart():
    loaded = helm.Chart.load(CHART)
    yield loaded
    loaded.close()


def _flags(objects: list[dict], role: str) -> dict[str, str]:
    """The role's parsed ``--device`` and ``--dtype``, as the real parser reads its container's args."""
    args = _parser().parse_args(container(role_workload(objects, role))["args"])
    return {"device": args.device, "dtype": args.dtype}


def test_defaults_compute_in_float32_on_the_cpu_for_both(chart):
    _, objects = render(chart, {})
    assert _flags(objects, "target") == _flags(objects, "draft") == {"device": "cpu", "dtype": "auto"}


def test_half_precision_on_gpus_reaches_both_services(chart):
    values = {
        "target": {"device": "cuda", "gpusPerPod": 1, "dtype": "bfloat16"},
        "draft": {"device": "cuda", "gpus": 1, "dtype": "float16"},
    }
    _, objects = render(chart, values)
    assert _flags(objects, "target") == {"device": "cuda", "dtype": "bfloat16"}
    assert _flags(objects, "draft") == {"device": "cuda", "dtype": "float16"}


@pytest.mark.parametrize("mode", [None, "wait", "off"])
def test_the_targets_compile_mode_reaches_its_flags(chart, mode):
    _, objects = render(chart, {"target": {"compile": mode}} if mode else {})
    args = _parser().parse_args(container(role_workload(objects, "target"))["args"])
    assert args.compile == (mode or "background")


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"target": {"compile": "fast"}}, "compile"),
        ({"draft": {"device": "cuda"}}, "draft.gpus"),
        ({"draft": {"dtype": "int8"}}, "dtype"),
        ({"target": {"dtype": "half"}}, "dtype"),
        ({"draft": {"device": "tpu"}}, "device"),
    ],
)
def test_values_the_services_would_refuse_fail_to_render(chart, bad, message):
    with pytest.raises(helm.HelmError, match=message):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)
