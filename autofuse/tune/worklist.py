"""Several tuning workers, on one machine's GPUs or many machines', sharing one list of keys
through an Optuna storage (a journal file, or an RDB such as SQLite or PostgreSQL).

No scheduler: every worker expands the same shapes into the same ordered keys and claims one by
creating an Optuna study named after it. A study name exists once in a storage, so exactly one
worker's creation succeeds, on a journal file (appends under a file lock) as on a database (a
unique column). The claim study's user attributes carry the worker's heartbeat and progress (set
after every trial) and, when the key is done, its winner. A key whose claim stopped beating for
`stale_after_s` (its worker was killed) is claimed again under the next generation's name, again by
exactly one worker, which resumes it from the trials the local cache kept: on the same machine only
the running trial is lost. Clocks of the machines sharing a storage are assumed in sync (NTP).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import Iterable

from ..errors import AutofuseError, shown
from ..store import Store, Winner
from .driver import Job, TuneOptions, tune_key

_PREFIX = "autofuse"
logger = logging.getLogger("autofuse")


# A heartbeat this far ahead of this machine's clock is no time a worker wrote (clocks are in sync):
# taken as stale, so that a forged one cannot hold a key forever.
MAX_CLOCK_SKEW_S = 300.0


def storage_errors(method):
    """`method` of a WorkList (or open_storage), with whatever the storage raises for content it cannot
    read (a journal line that is not JSON, a file that is not a database, a server gone) turned into one
    AutofuseError line naming the storage."""
    @functools.wraps(method)
    def guarded(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except AutofuseError:
            raise
        except Exception as e:  # noqa: BLE001 - optuna, SQLAlchemy and the journal raise many kinds
            first_line = (str(e).strip().splitlines() or [""])[0]
            raise AutofuseError(f"the shared tuning storage cannot be used ({type(e).__name__}: "
                                f"{shown(first_line, 120)})") from None
    return guarded


@storage_errors
def open_storage(url: str):
    """An Optuna storage for `url`: an RDB URL (sqlite:///..., postgresql://..., mysql://...) or a
    journal file path (optionally written journal:PATH), which works on any shared file system."""
    # optuna is imported where it is used, not at the top: only a shared tuning run needs it.
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if "://" in url:
        return _rdb_storage(optuna, url)
    return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))


def _rdb_storage(optuna, url: str, attempts: int = 6):
    """Optuna's RDB storage for `url`. Machines that start a run at once on an empty PostgreSQL database all create
    its tables: one wins, the others fail on its rows (duplicate types or relations) and, tried again, find the
    tables made (SQLite serialises this behind its file lock, PostgreSQL does not)."""
    import sqlalchemy.exc

    for attempt in range(attempts - 1):
        try:
            return optuna.storages.RDBStorage(url)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            time.sleep(0.2 * (attempt + 1))
    return optuna.storages.RDBStorage(url)


def run_name(jobs: Iterable[Job], settings: dict) -> str:
    """Names one tuning run: the same keys and settings give the same name, so the same command
    started on several machines joins one run."""
    text = json.dumps([[job.key.id(), job.M] for job in jobs] + [settings], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclasses.dataclass
class Claim:
    job_index: int
    generation: int
    attrs: dict


class WorkList:
    """The keys of one run and their claims, as the storage holds them."""

    def __init__(self, storage, run: str, jobs: list[Job]) -> None:
        self.storage, self.run, self.jobs = storage, run, jobs
        self._skipped: set[tuple[str, str]] = set()

    def _name(self, index: int, generation: int) -> str:
        return f"{_PREFIX}/{self.run}/{index:05d}/{generation}"

    @storage_errors
    def claims(self) -> dict[int, Claim]:
        """The newest claim of every claimed job. The storage may be shared with other people's runs
        and machines: a study of this run that is not what a worker writes (a key index that is no
        number or no job, a winner that does not validate, a heartbeat that is no time) is skipped
        or taken as not done, with one warning, never trusted."""
        newest: dict[int, Claim] = {}
        for study in self.storage.get_all_studies():
            parts = study.study_name.split("/")
            if len(parts) != 4 or parts[0] != _PREFIX or parts[1] != self.run:
                continue  # another run's, or not autofuse's at all
            claim = self._claim_of(study.study_name, parts, dict(study.user_attrs))
            if claim is not None and (claim.job_index not in newest or
                                      claim.generation > newest[claim.job_index].generation):
                newest[claim.job_index] = claim
        return newest

    def _claim_of(self, name: str, parts: list[str], attrs: dict) -> Claim | None:
        if not (parts[2].isdigit() and parts[3].isdigit()) or int(parts[2]) >= len(self.jobs):
            self._skip(name, "its key index is not one of this run's keys")
            return None
        index = int(parts[2])
        heartbeat = attrs.get("heartbeat")  # None: claimed, its first heartbeat not written yet (see _pick)
        if heartbeat is not None and (isinstance(heartbeat, bool) or not isinstance(heartbeat, (int, float))
                                      or not math.isfinite(heartbeat) or heartbeat > time.time() + MAX_CLOCK_SKEW_S):
            self._skip(name, f"its heartbeat {shown(heartbeat, 24)} is not a time: taken as stale")
            attrs["heartbeat"] = 0
        worker = attrs.get("worker")
        if not isinstance(worker, str) or not worker.isprintable() or len(worker) > 64:  # printed in the progress
            attrs["worker"] = "?"
        if attrs.get("done"):
            try:
                attrs["winner"] = Winner.from_record(attrs.get("winner"))
                if attrs["winner"].key != self.jobs[index].key:
                    raise ValueError("it is another key's")
            except (ValueError, TypeError) as e:
                self._skip(name, f"its winner is not valid ({shown(str(e), 120)}): the key is tuned again")
                attrs["done"] = False
        return Claim(index, int(parts[3]), attrs)

    def _skip(self, name: str, why: str) -> None:
        if (name, why) not in self._skipped:  # once per study and problem: the storage is polled
            self._skipped.add((name, why))
            logger.warning("autofuse: shared storage study %s: %s", name, why)

    @storage_errors
    def try_claim(self, index: int, generation: int, worker: str) -> int | None:
        """The claim study's id if this worker got the job (generation 0: first claim, later: a takeover)."""
        from optuna.exceptions import DuplicatedStudyError  # see open_storage: optuna only where it is used
        from optuna.study import StudyDirection

        try:
            study_id = self.storage.create_new_study([StudyDirection.MINIMIZE], self._name(index, generation))
        except DuplicatedStudyError:
            return None
        self.set(study_id, heartbeat=time.time(), worker=worker, done=False)
        return study_id

    @storage_errors
    def set(self, study_id: int, **attrs) -> None:
        for key, value in attrs.items():
            self.storage.set_study_user_attr(study_id, key, value)

    def winners(self) -> list[Winner]:
        """Every finished key's winner as the storage holds it (from any worker, on any machine)."""
        # Validated like an imported file: the storage may be shared with other people's machines.
        return [c.attrs["winner"] for c in self.claims().values() if c.attrs.get("done")]

    def status(self) -> tuple[int, list[str]]:
        """(jobs done, one phrase per job in progress: worker, key, trials, best time) for the progress line."""
        claims = self.claims()
        done = sum(1 for c in claims.values() if c.attrs.get("done"))
        running = []
        for index, c in sorted(claims.items()):
            if not c.attrs.get("done"):
                best = c.attrs.get("best_ms")
                best = best if isinstance(best, (int, float)) and not isinstance(best, bool) else None
                job = self.jobs[index]
                running.append(f"{c.attrs.get('worker', '?')}: {job.label} M={job.M} trial "
                               f"{c.attrs.get('trials_done', 0)} best {'-' if best is None else f'{best:.4f} ms'}")
        return done, running


def work(work_list: WorkList, store: Store, device, worker: str, options: TuneOptions, *,
         stale_after_s: float = 120.0, poll_s: float = 1.0) -> list[int]:
    """Tune jobs of the shared list until every one is done (by this worker or another). Returns the
    indices this worker finished."""
    jobs = work_list.jobs
    finished = []
    unbeaten: dict[tuple[int, int], float] = {}  # (job, generation) of claims seen without a heartbeat -> when
    while True:
        claims = work_list.claims()
        if len(claims) == len(jobs) and all(c.attrs.get("done") for c in claims.values()):
            return finished
        picked = _pick(work_list, claims, worker, stale_after_s, unbeaten)
        if picked is None:
            time.sleep(poll_s)  # everything left is being tuned by live workers
            continue
        index, study_id, takeover = picked
        job = jobs[index]

        def beat(progress, study_id=study_id):
            work_list.set(study_id, heartbeat=time.time(), trials_done=progress.trials_done,
                          best_ms=progress.best_ms, baseline_ms=progress.baseline_ms)

        result = tune_key(job, store, device, options, progress=beat, resume=takeover or options.resume)
        found = result.not_stored or result.winner  # this run's winner: each machine's cache ranks it itself
        # Attributes are written one at a time: `done` last, so that no reader sees a done claim without its winner.
        work_list.set(study_id, heartbeat=time.time(), winner=found.to_record(), trials_done=result.winner.trials,
                      done=True)
        finished.append(index)


def _pick(work_list: WorkList, claims: dict[int, Claim], worker: str, stale_after_s: float,
          unbeaten: dict[tuple[int, int], float]):
    """(job index, claim study id, whether it is a takeover) of a job this worker now owns, or None.
    Largest M first: the longest keys start early, so the run does not end on one worker finishing
    a big key while the others idle. A claim is stale once its heartbeat is stale_after_s old; one without a
    heartbeat (its worker creates the claim, then writes the first beat) once this worker has seen it without one
    for stale_after_s (`unbeaten`, kept across calls): read as 0, a claim made a moment ago would look stale at
    once, and its key would be tuned twice."""
    jobs = work_list.jobs
    for index in sorted(range(len(jobs)), key=lambda i: (-jobs[i].M, i)):
        if index not in claims:
            study_id = work_list.try_claim(index, 0, worker)
            if study_id is not None:
                return index, study_id, False
    now = time.time()
    for index, claim in sorted(claims.items()):
        if claim.attrs.get("done"):
            continue
        heartbeat = claim.attrs.get("heartbeat")
        if heartbeat is None:
            heartbeat = unbeaten.setdefault((index, claim.generation), now)
        if now - heartbeat > stale_after_s:
            study_id = work_list.try_claim(index, claim.generation + 1, worker)
            if study_id is not None:
                return index, study_id, True
    return None
