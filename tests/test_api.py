"""The Java-mirror surface: FusedBatchNormGrad.create / options / accessors, Scope, and the
functional fused_batch_norm_grad. Attributes are checked on the built tf.Operation."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import fbn_grad_tf  # noqa: E402
from fbn_grad_tf import FusedBatchNormGrad, Scope  # noqa: E402
from helpers import assert_bitwise_equal, make_inputs, run_ours  # noqa: E402

OUTPUT_NAMES = ("x_backprop", "scale_backprop", "offset_backprop", "reserve_space_4",
                "reserve_space_5")
CAMEL = {"x_backprop": "xBackprop", "scale_backprop": "scaleBackprop",
         "offset_backprop": "offsetBackprop", "reserve_space_4": "reserveSpace4",
         "reserve_space_5": "reserveSpace5"}


@pytest.fixture(scope="module")
def inputs():
    return make_inputs((2, 3, 4, 5), "NHWC", "float32", True, seed=21)


@pytest.fixture(scope="module")
def nchw_inputs():
    return make_inputs((2, 5, 3, 4), "NCHW", "float32", False, seed=22)


def build(graph, inputs, *options, scope=None):
    """Builds the op in `graph` from constants; returns the FusedBatchNormGrad."""
    with graph.as_default():
        consts = [tf.constant(a) for a in inputs]
    return FusedBatchNormGrad.create(scope or Scope(graph), *consts, *options)


def attrs(op):
    return (op.get_attr("epsilon"), op.get_attr("data_format"), op.get_attr("is_training"))


# ---- names ----------------------------------------------------------------------------------

def test_op_names():
    assert FusedBatchNormGrad.OP_NAME == "FbnGrad>FusedBatchNormGradV3"
    assert FusedBatchNormGrad.OP_NAME == fbn_grad_tf.REGISTERED_OP_NAME
    assert FusedBatchNormGrad.MIRRORED_OP_NAME == "FusedBatchNormGradV3"
    assert fbn_grad_tf.DATA_FORMATS == ("NHWC", "NCHW", "NDHWC", "NCDHW")
    assert fbn_grad_tf.FusedBatchNormGradOutputs._fields == OUTPUT_NAMES


def test_graph_op_type_inputs_and_default_attrs(inputs):
    g = tf.Graph()
    res = build(g, inputs)
    op = res.op
    assert op.type == FusedBatchNormGrad.OP_NAME
    assert op.graph is g
    assert len(op.inputs) == 6 and len(op.outputs) == 5
    assert [t.dtype for t in op.inputs] == [tf.float32] * 6
    eps, fmt, training = attrs(op)
    assert eps == pytest.approx(1e-4, rel=1e-6)
    assert fmt == b"NHWC" and training is True
    assert op.get_attr("T") == tf.float32 and op.get_attr("U") == tf.float32
    assert op.name == FusedBatchNormGrad.DEFAULT_NAME


# ---- options ----------------------------------------------------------------------------------

@pytest.mark.parametrize("make_options,expected", [
    (lambda: [FusedBatchNormGrad.epsilon(1e-3)], (1e-3, b"NHWC", True)),
    (lambda: [FusedBatchNormGrad.data_format("NCHW")], (1e-4, b"NCHW", True)),
    (lambda: [FusedBatchNormGrad.dataFormat("NCHW")], (1e-4, b"NCHW", True)),
    (lambda: [FusedBatchNormGrad.is_training(False)], (1e-4, b"NHWC", False)),
    (lambda: [FusedBatchNormGrad.isTraining(False)], (1e-4, b"NHWC", False)),
    # chained on one Options object, snake_case and camelCase
    (lambda: [FusedBatchNormGrad.epsilon(1e-3).data_format("NCHW").is_training(False)],
     (1e-3, b"NCHW", False)),
    (lambda: [FusedBatchNormGrad.epsilon(2e-3).dataFormat("NCHW").isTraining(False)],
     (2e-3, b"NCHW", False)),
    # later option wins, across objects and within a chain
    (lambda: [FusedBatchNormGrad.epsilon(1e-3), FusedBatchNormGrad.epsilon(0.5)],
     (0.5, b"NHWC", True)),
    (lambda: [FusedBatchNormGrad.is_training(False), FusedBatchNormGrad.is_training(True)],
     (1e-4, b"NHWC", True)),
    (lambda: [FusedBatchNormGrad.data_format("NCHW").data_format("NHWC")],
     (1e-4, b"NHWC", True)),
    (lambda: [FusedBatchNormGrad.epsilon(1e-3).is_training(False),
              FusedBatchNormGrad.epsilon(0.25)], (0.25, b"NHWC", False)),
    # a list of options is flattened
    (lambda: [[FusedBatchNormGrad.epsilon(0.125), FusedBatchNormGrad.is_training(False)]],
     (0.125, b"NHWC", False)),
    # numpy scalars
    (lambda: [FusedBatchNormGrad.epsilon(np.float32(0.5)).is_training(False)],
     (0.5, b"NHWC", False)),
    (lambda: [FusedBatchNormGrad.data_format(b"NHWC")], (1e-4, b"NHWC", True)),
])
def test_options_reach_op_attrs(inputs, nchw_inputs, make_options, expected):
    options = make_options()
    fmt = expected[1].decode()
    res = build(tf.Graph(), inputs if fmt == "NHWC" else nchw_inputs, *options)
    eps, got_fmt, training = attrs(res.op)
    assert eps == pytest.approx(expected[0], rel=1e-6)
    assert (got_fmt, training) == expected[1:]


@pytest.mark.parametrize("how", ["option", "functional"])
def test_numpy_bool_is_training_accepted(inputs, how):
    if how == "option":
        res = build(tf.Graph(), inputs, FusedBatchNormGrad.is_training(np.bool_(False)))
        assert res.op.get_attr("is_training") is False
    else:
        out = fbn_grad_tf.fused_batch_norm_grad(*inputs, is_training=np.bool_(False))
        assert_bitwise_equal(out[0].numpy(), run_ours(inputs, is_training=False)[0])


def test_options_reach_the_kernel(nchw_inputs):
    """Eager: attributes set through options give the functional API's numbers."""
    out = FusedBatchNormGrad.create(None, *nchw_inputs, FusedBatchNormGrad.epsilon(1e-2),
                                    FusedBatchNormGrad.data_format("NCHW").is_training(False))
    expected = run_ours(nchw_inputs, 1e-2, "NCHW", False)
    for a, b in zip(out, expected):
        assert_bitwise_equal(a.numpy(), b)
    # and they matter: a different epsilon gives different numbers
    other = run_ours(nchw_inputs, 1e-4, "NCHW", False)
    assert not np.allclose(other[0], expected[0], rtol=1e-4)


def test_options_object_and_repr():
    opt = FusedBatchNormGrad.epsilon(1e-3)
    assert isinstance(opt, FusedBatchNormGrad.Options)
    assert opt.data_format("NCHW") is opt  # chainable, returns itself
    assert "NCHW" in repr(opt)
    assert isinstance(FusedBatchNormGrad.Options(), FusedBatchNormGrad.Options)


@pytest.mark.parametrize("bad,exc", [
    (lambda: FusedBatchNormGrad.data_format("NWHC"), ValueError),
    (lambda: FusedBatchNormGrad.data_format("nhwc"), ValueError),
    (lambda: FusedBatchNormGrad.data_format(4), TypeError),
    (lambda: FusedBatchNormGrad.epsilon("0.1"), TypeError),
    (lambda: FusedBatchNormGrad.epsilon(True), TypeError),
    (lambda: FusedBatchNormGrad.epsilon(None), TypeError),
    (lambda: FusedBatchNormGrad.is_training(1), TypeError),
    (lambda: FusedBatchNormGrad.is_training("true"), TypeError),
    (lambda: FusedBatchNormGrad.epsilon(1e-3).isTraining(None), TypeError),
])
def test_bad_option_values(bad, exc):
    with pytest.raises(exc):
        bad()


@pytest.mark.parametrize("bad_option", [
    "epsilon=1e-3", {"epsilon": 1e-3}, 1e-3, None, FusedBatchNormGrad.Options,
])
def test_bad_option_object(inputs, bad_option):
    with pytest.raises(TypeError, match="Options"):
        FusedBatchNormGrad.create(None, *inputs, bad_option)


@pytest.mark.parametrize("bad_scope", ["scope", tf.Graph, 0, object()])
def test_bad_scope(inputs, bad_scope):
    if bad_scope is tf.Graph:
        bad_scope = tf.Graph()  # a graph is not a Scope: Scope(graph) is
    with pytest.raises(TypeError, match="Scope"):
        FusedBatchNormGrad.create(bad_scope, *inputs)


def test_scope_rejects_bad_graph_and_names():
    with pytest.raises(TypeError):
        Scope("graph")
    with pytest.raises(ValueError):
        Scope().with_name("")
    with pytest.raises(ValueError):
        Scope().with_sub_scope("")
    with pytest.raises(ValueError):
        Scope().with_name(None)
    # Checked when the scope is made (as Java's Scope does), also in eager code, where no
    # op name is ever used.
    for bad in ("a b", "/abs", "x:0", "_lead"):
        with pytest.raises(ValueError, match="not a valid TensorFlow name"):
            Scope().with_name(bad)
        with pytest.raises(ValueError, match="not a valid TensorFlow name"):
            Scope().with_sub_scope(bad)
    with pytest.raises(TypeError, match="device must be a string"):
        Scope().with_device(None)
    with pytest.raises(ValueError):
        Scope().with_device("/bogus:x:y")


def test_scope_control_dependencies_take_one_op_or_a_list():
    g = tf.Graph()
    with g.as_default():
        a, b, e = tf.constant(1.0), tf.constant(2.0), tf.constant(3.0)
        one = Scope(g).with_control_dependencies(a)
        many = Scope(g).withControlDependencies([a.op, b])
        with one.context():
            c = tf.identity(b)
        with many.context():
            d = tf.identity(e)
    assert a.op in c.op.control_inputs
    assert {a.op, b.op} <= set(d.op.control_inputs)


# ---- outputs --------------------------------------------------------------------------------

def test_accessors_iteration_unpacking(inputs):
    res = FusedBatchNormGrad.create(Scope(), *inputs)
    assert len(res) == 5
    listed = list(res)
    assert len(listed) == 5
    dx, dscale, doffset, rs4, rs5 = res  # unpacking
    for i, name in enumerate(OUTPUT_NAMES):
        via_snake = getattr(res, name)()
        via_camel = getattr(res, CAMEL[name])()
        assert via_snake is via_camel is res[i] is listed[i]
        assert via_snake is getattr(res.outputs(), name)
    assert dx.shape == inputs.x.shape and dscale.shape == (5,) and doffset.shape == (5,)
    assert rs4.shape == (0,) and rs5.shape == (0,)
    expected = run_ours(inputs)
    for a, b in zip(res, expected):
        assert_bitwise_equal(a.numpy(), b)
    assert res.op is None  # eager: no tf.Operation
    assert "x_backprop" in repr(res)


def test_graph_outputs_are_the_op_outputs(inputs):
    res = build(tf.Graph(), inputs)
    assert list(res) == list(res.op.outputs)
    assert "x_backprop" in repr(res)


def test_functional_api(inputs):
    out = fbn_grad_tf.fused_batch_norm_grad(*inputs)
    assert isinstance(out, fbn_grad_tf.FusedBatchNormGradOutputs)
    assert out._fields == OUTPUT_NAMES
    g = tf.Graph()
    with g.as_default():
        out = fbn_grad_tf.fused_batch_norm_grad(*[tf.constant(a) for a in inputs], name="bn_g")
    assert out.x_backprop.op.name == "bn_g"
    assert out.x_backprop.op.type == FusedBatchNormGrad.OP_NAME


# ---- Scope ----------------------------------------------------------------------------------

def test_scope_with_name(inputs):
    g = tf.Graph()
    scope = Scope(g)
    named = scope.with_name("my_bn_grad")
    assert build(g, inputs, scope=named).op.name == "my_bn_grad"
    # TF unique-ifies a repeated name; the original scope is unchanged (immutable).
    assert build(g, inputs, scope=named).op.name == "my_bn_grad_1"
    assert build(g, inputs, scope=scope).op.name == FusedBatchNormGrad.DEFAULT_NAME
    assert build(g, inputs, scope=scope.withName("camel")).op.name == "camel"


def test_scope_with_sub_scope(inputs):
    g = tf.Graph()
    scope = Scope(g).with_sub_scope("outer").withSubScope("inner")
    op = build(g, inputs, scope=scope).op
    assert op.name == "outer/inner/" + FusedBatchNormGrad.DEFAULT_NAME
    # a sub-scope resets the op name, as in Java
    op = build(g, inputs, scope=Scope(g).with_name("n").with_sub_scope("s")).op
    assert op.name == "s/" + FusedBatchNormGrad.DEFAULT_NAME
    g2 = tf.Graph()
    assert build(g2, inputs, scope=Scope(g2).with_sub_scope("a").with_name("n")).op.name == "a/n"


def test_scope_sub_scope_is_stable_across_ops(inputs):
    g = tf.Graph()
    scope = Scope(g).with_sub_scope("outer").with_sub_scope("inner")
    first = build(g, inputs, scope=scope).op.name
    second = build(g, inputs, scope=scope).op.name
    third = build(g, inputs, scope=scope.with_name("n")).op.name
    assert first == "outer/inner/FusedBatchNormGrad"
    assert second == "outer/inner/FusedBatchNormGrad_1"
    assert third == "outer/inner/n"


@pytest.mark.parametrize("device", ["/CPU:0", "/device:CPU:0"])
def test_scope_with_device(inputs, device):
    g = tf.Graph()
    op = build(g, inputs, scope=Scope(g).with_device(device)).op
    assert tf.DeviceSpec.from_string(op.device).device_type == "CPU"
    assert tf.DeviceSpec.from_string(op.device).device_index == 0
    spec = tf.DeviceSpec(device_type="CPU", device_index=0)
    op = build(g, inputs, scope=Scope(g).withDevice(spec)).op
    assert tf.DeviceSpec.from_string(op.device).device_type == "CPU"
    assert build(g, inputs).op.device == ""


def test_scope_with_control_dependencies(inputs):
    g = tf.Graph()
    with g.as_default():
        a = tf.constant(1.0, name="dep_a")
        b = tf.no_op(name="dep_b")
    scope = Scope(g).with_control_dependencies([a])
    op = build(g, inputs, scope=scope).op
    assert a.op in op.control_inputs
    op = build(g, inputs, scope=scope.withControlDependencies([b])).op
    assert a.op in op.control_inputs and b in op.control_inputs
    assert build(g, inputs, scope=Scope(g)).op.control_inputs == []


def test_scope_graph_builds_into_that_graph(inputs):
    g1, g2 = tf.Graph(), tf.Graph()
    with g1.as_default():  # the default graph is g1, the scope says g2
        with g2.as_default():
            consts = [tf.constant(a) for a in inputs]
        res = FusedBatchNormGrad.create(Scope(g2), *consts)
    assert res.op.graph is g2
    assert not g1.get_operations()
    assert Scope(g2).graph is g2 and Scope().graph is None


def test_scope_none_means_current_context(inputs):
    # eager
    res = FusedBatchNormGrad.create(None, *inputs)
    assert res.op is None and isinstance(res.x_backprop(), tf.Tensor)
    assert Scope().is_eager()
    # the default graph
    g = tf.Graph()
    with g.as_default():
        res = FusedBatchNormGrad.create(None, *[tf.constant(a) for a in inputs])
        assert not Scope().is_eager()
    assert res.op.graph is g
    # a tf.function being traced
    graphs = []

    @tf.function
    def f(*args):
        r = FusedBatchNormGrad.create(None, *args, FusedBatchNormGrad.epsilon(1e-3))
        graphs.append(r.op.graph)
        return r.x_backprop()

    dx = f(*[tf.constant(a) for a in inputs])
    assert isinstance(graphs[0], tf.Graph)
    assert_bitwise_equal(dx.numpy(), run_ours(inputs, 1e-3)[0])


def test_scope_repr_and_immutability():
    g = tf.Graph()
    s = Scope(g)
    s2 = s.with_name("a").with_sub_scope("b").with_device("/CPU:0")
    assert s2 is not s
    for scope in (s, s2, Scope(), s2.with_control_dependencies([])):
        assert repr(scope).startswith("Scope(")
    assert "b" in repr(s2) and "CPU" in repr(s2)
    assert "CPU" not in repr(s) and s.make_op_name("X") == "X"
    assert s.with_name("a").make_op_name("X") == "a"
