"""Who hears an event, and what they are told (pure).

Events, by name: `job.ended` (succeeded, failed with its class, cancelled), `job.hung`,
`job.restarted`, `node.lost` and `node.quarantined` (staff only), `quota.changed`,
`experiment.ended`. A subscription is a user's own or, made by one of its members, a team's:
- a user's hears the events of what they own (their jobs and experiments, their own quota) and
  their teams' events that belong to no one (a team's quota), and, if they are staff, the staff
  events;
- a team's hears the events of the team's jobs and experiments and its quota, as long as the
  member who made it is still in the team; never a staff event.
So nobody hears of a job they could not see (jobs/access/selectors.py: own, team's, staff all)."""
from __future__ import annotations

from dataclasses import dataclass

EVENTS = ("job.ended", "job.hung", "job.restarted", "node.lost", "node.quarantined", "quota.changed",
          "experiment.ended")
STAFF_EVENTS = frozenset({"node.lost", "node.quarantined"})
FORMATS = ("json", "slack")


@dataclass(frozen=True)
class Event:
    name: str
    text: str                   # one line for people: an email's subject, Slack's text
    owner_id: int | None        # the user it belongs to (a job's owner), if any
    team_id: int | None         # the team it belongs to, if any
    body: dict                  # JSON details: {"job": {...}} / {"node": {...}} / {"quota": {...}} / ...

    @property
    def staff_only(self) -> bool:
        return self.name in STAFF_EVENTS


@dataclass(frozen=True)
class Subscriber:
    user_id: int
    user_is_staff: bool
    user_team_ids: frozenset[int]
    team_id: int | None         # a team's subscription; None: the user's own
    events: frozenset[str]


def hears(sub: Subscriber, event: Event) -> bool:
    if event.name not in sub.events:
        return False
    if event.staff_only:
        return sub.team_id is None and sub.user_is_staff
    if sub.team_id is not None:
        return event.team_id == sub.team_id and sub.team_id in sub.user_team_ids
    if event.owner_id is not None:
        return event.owner_id == sub.user_id
    return event.team_id is not None and event.team_id in sub.user_team_ids


def check_events(events, *, staff: bool, team: bool) -> list[str]:
    """The subscription's event list, or a ValueError naming what is wrong."""
    if not isinstance(events, list) or not events:
        raise ValueError(f"give a non-empty list of events, any of: {', '.join(EVENTS)}")
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        raise ValueError(f"unknown event {str(unknown[0])[:60]!r}; the events are: {', '.join(EVENTS)}")
    staff_events = sorted(set(events) & STAFF_EVENTS)
    if staff_events and (team or not staff):
        raise ValueError(f"{', '.join(staff_events)}: staff only, and only on a user's own subscription")
    return sorted(set(events), key=EVENTS.index)


def job_event_text(job: dict, kind: str, message: str, data: dict) -> str:
    """One line for a job's event: `job 7 "gpt-demo" failed (user_error): <message>`."""
    head = f'job {job["id"]} "{job["name"][:80]}"'
    if kind == "failed":
        cls = data.get("failure_class")
        return f"{head} failed" + (f" ({cls})" if cls else "") + (f": {message}" if message else "")
    if kind == "hang_detected":
        return f"{head} is hung: {message}"
    if kind == "restart":
        return f"{head} restarted: {message}"
    return f"{head} {kind}" + (f": {message}" if message else "")


def other_text(name: str, data: dict) -> str:
    """One line for an event announced through notify_event: `data["text"]` if given; an
    experiment's from its id, name and status; else the event's name."""
    if isinstance(data.get("text"), str) and data["text"]:
        return data["text"][:300]
    if "experiment" in data:
        best = data.get("best") or {}
        metric = f", best {best.get('metric')} (job {best.get('job')})" if isinstance(best, dict) and best else ""
        return (f'experiment {data["experiment"]} "{str(data.get("name", ""))[:80]}" ended: '
                f'{data.get("status", "")}{metric}')
    return name


def payload(event: Event, *, fmt: str, delivery: int, created_at: str) -> dict:
    """What a webhook receives: the event's JSON, or Slack's `{"text": ...}`."""
    if fmt == "slack":
        return {"text": f"Trainyard: {event.text}"}
    return {"event": event.name, "delivery": delivery, "created_at": created_at, "text": event.text, **event.body}


def email_message(event: Event, *, link: str) -> tuple[str, str]:
    """Subject and plain-text body of an event's email."""
    subject = f"[Trainyard] {event.text}"
    subject = subject if len(subject) <= 150 else subject[:149] + "\u2026"
    lines = [event.text, ""] + ([link, ""] if link else []) + [
        f"Event: {event.name}", "",
        "You get this mail because of a Trainyard notification subscription; manage them at /notifications/."]
    return subject, "\n".join(lines)
