"""List the runs and metrics of an MLflow file store with MLflow's own client; print JSON.

Exit 3 when the mlflow package is not installed.
"""
import json
import os
import sys

# MLflow 3 keeps the file store readable behind this switch
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

try:
    from mlflow.tracking import MlflowClient
except ImportError as e:
    print(f"mlflow not installed: {e}", file=sys.stderr)
    sys.exit(3)

client = MlflowClient(tracking_uri=sys.argv[1])
out = []
for exp in client.search_experiments():
    for run in client.search_runs([exp.experiment_id]):
        metrics = {}
        for name in run.data.metrics:
            metrics[name] = [[m.step, m.value] for m in client.get_metric_history(run.info.run_id, name)]
        out.append({
            "experiment": exp.name,
            "run_id": run.info.run_id,
            "run_name": run.info.run_name,
            "status": run.info.status,
            "params": run.data.params,
            "tags": {k: v for k, v in run.data.tags.items() if k.startswith("cockpit.")},
            "metrics": metrics,
            "artifacts": [a.path for a in client.list_artifacts(run.info.run_id)],
            "plots": [a.path for a in client.list_artifacts(run.info.run_id, "plots")],
        })
print(json.dumps(out))
