"""What `tensorboard --logdir DIR` finds: every run under DIR (EventMultiplexer), with its
train/loss steps and its HParams session hyperparameters; print JSON.

Exit 3 when the tensorboard package is not installed.
"""
import json
import sys

try:
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
    from tensorboard.plugins.hparams import plugin_data_pb2
except ImportError as e:
    print(f"tensorboard not installed: {e}", file=sys.stderr)
    sys.exit(3)

mux = pem.EventMultiplexer()
mux.AddRunsFromDirectory(sys.argv[1])
mux.Reload()
out = {}
for run in sorted(mux.Runs()):
    acc = mux.GetAccumulator(run)
    # as the dashboard reads them: scalars migrated to tensors of the scalars plugin
    tensors = acc.Tags()["tensors"]
    steps = [e.step for e in acc.Tensors("train/loss")] if "train/loss" in tensors else []
    hp = {}
    for _tag, content in acc.PluginTagToContent("hparams").items():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.WhichOneof("data") == "session_start_info":
            for k, v in data.session_start_info.hparams.items():
                hp[k] = getattr(v, v.WhichOneof("kind"))
    out[run] = {"steps": steps, "hparams": hp}
print(json.dumps(out))
