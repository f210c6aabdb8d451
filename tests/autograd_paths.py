"""Which path a fake quantization took, read from the autograd graph behind its output: the Triton kernels' nodes or
the pure-torch reference's (``FakeQuantSTE``)."""

KERNEL_NODES = {"GroupedInputFakeQuantBackward", "GroupedWeightFakeQuantBackward"}
REFERENCE_NODE = "FakeQuantSTEBackward"


def graph_nodes(*tensors) -> set[str]:
    """Names of every autograd node behind ``tensors``."""
    seen, names, stack = set(), set(), [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return names


def assert_kernel_path(nodes: set[str], *context) -> None:
    """The kernels ran and the reference did not."""
    assert KERNEL_NODES & nodes, (context, nodes)
    assert REFERENCE_NODE not in nodes, (context, nodes)


def assert_reference_path(nodes: set[str], *context) -> None:
    """The reference ran and the kernels did not."""
    assert REFERENCE_NODE in nodes, (context, nodes)
    assert not KERNEL_NODES & nodes, (context, nodes)
