"""Read a run's TensorBoard logs with TensorBoard's own EventAccumulator; print JSON.

Exit 3 when the tensorboard package is not installed.
"""
import json
import sys

try:
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.plugins.hparams import plugin_data_pb2
except ImportError as e:
    print(f"tensorboard not installed: {e}", file=sys.stderr)
    sys.exit(3)

acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
acc.Reload()
tags = acc.Tags()
out = {"scalars": {}, "text": {}, "hparams": {}}
for tag in tags["scalars"]:
    out["scalars"][tag] = [[e.step, e.value] for e in acc.Scalars(tag)]
for tag in tags["tensors"]:
    events = acc.Tensors(tag)
    meta = acc.SummaryMetadata(tag)
    plugin = meta.plugin_data.plugin_name
    if plugin == "text":
        out["text"][tag] = [e.tensor_proto.string_val[0].decode() for e in events]
# the HParams dashboard reads the plugin's metadata (no tensor): as TensorBoard does
for tag, content in acc.PluginTagToContent("hparams").items():
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    which = data.WhichOneof("data")
    if which == "session_start_info":
        hp = {}
        for k, v in data.session_start_info.hparams.items():
            hp[k] = getattr(v, v.WhichOneof("kind"))
        out["hparams"]["start"] = hp
        out["hparams"]["group"] = data.session_start_info.group_name
    elif which == "session_end_info":
        out["hparams"]["end_status"] = data.session_end_info.status
print(json.dumps(out))
