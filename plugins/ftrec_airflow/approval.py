"""The optional human approval before the champion alias moves (DAG param champion_approval).

register_model registers every version that passes the gate as `challenger`; with approval on,
a winner is held back from `champion` and approve_champion asks a person (Airflow's
human-in-the-loop approval: the task waits in `awaiting_input`, holding no worker slot, and
the Airflow UI or REST API answers it). Approve: promote_champion moves the alias. Reject, or
no answer within champion_approval_hours: promote_champion is skipped, the champion stays, the
version stays challenger. With approval off (the default), or a version that did not win,
approve_champion returns at once and asks nobody.
"""

from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator


class ChampionApproval(ApprovalOperator):
    """Approve or Reject the version register_model held back; Reject when nobody answers in time."""

    def __init__(self, *, register_task_id: str = "register_model", **kwargs: Any) -> None:
        super().__init__(subject="Make the registered version champion?", defaults=self.REJECT, **kwargs)
        self.register_task_id = register_task_id

    def execute(self, context: Any) -> Any:
        reg = context["ti"].xcom_pull(task_ids=self.register_task_id) or {}
        held = reg.get("approval") or {}
        if not held.get("asked"):
            self.log.info("nothing to approve: approval is off, or the version did not beat the champion")
            return {"asked": False}
        self.subject = f"Make version {reg['version']} of {reg['name']} champion?"
        self.body = body(reg)
        self.response_timeout = timedelta(hours=held["hours"])
        return super().execute(context)


def body(reg: dict) -> str:
    """The question's details (markdown): the verdict and both models' scores on the same split."""
    lines = [f"The quality gate's verdict: **{reg['approval']['reason']}**.", ""]
    metrics = list(reg["scores"]["challenger"])
    lines += ["| model | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for who, scores in reg["scores"].items():
        cells = ["not scored" if v is None else f"{v:.6f}" for v in scores.values()]
        lines.append(f"| {who} | " + " | ".join(cells) + " |")
    hours, now = reg["approval"]["hours"], reg["champion"]
    lines += ["", f"Approve: version {reg['version']} becomes `champion`."]
    lines.append(
        f"Reject, or no answer in {hours:g} h: the champion stays ({'version ' + str(now) if now else 'none'})."
    )
    return "\n".join(lines)
