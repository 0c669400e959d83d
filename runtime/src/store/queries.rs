//! Every statement of the store, written once. Placeholders in braces are
//! filled from the backend's [`Dialect`] when a store opens; parameters are
//! `$N` on every backend. Statements that take a [`super::dialect::RowSet`]
//! (batched writes) read it as the FROM item `t` and take no other
//! parameter.

use super::dialect::{ColType, Dialect};
use super::{ERROR_HISTORY, MAX_UNSTARTED_RESCUES};
use crate::failure::Code;

const JOB_COLS: &str = "id, queue, plugin, payload, idempotency_key, priority, run_at, state, \
    attempt, max_attempts, lease_owner, lease_until, heartbeat_at, last_error_code, \
    last_error_message, {errors} AS errors, correlation_id, plugin_hash, plan, plan_hash, rescues, \
    started, unstarted_rescues, created_at, updated_at, finished_at, first_failed_at, last_failed_at, deferred_since, \
    interruptions, group_key";

const EFFECT_COLS: &str = "key, job_id, plugin, provider, fingerprint, status, attempt, \
    lease_owner, lease_until, result_ref, last_error_code, last_error_at, created_at, updated_at, \
    reached, in_doubt, first_sent_at";

const SESSION_COLS: &str = "id_digest, token_fingerprint, created_at, expires_at, revoked_at";

/// The conflict target of an insert into `jobs`: the unique index of keyed
/// jobs (partial, so its predicate is named).
const KEY_CONFLICT: &str = "(plugin, idempotency_key) WHERE idempotency_key IS NOT NULL";

/// The fence of a batched job write against the row set `t`.
const JOB_FENCE: &str = "{job_ids}jobs.id = t.id AND {job_running} \
    AND jobs.lease_owner = t.owner AND jobs.attempt = t.attempt";

/// A group's open jobs: the predicate of the index `jobs_group_open`,
/// repeated word for word wherever a statement should read that index
/// (SQLite uses a partial index only for a query that names its terms).
const GROUP_OPEN: &str = "state IN ('available', 'retrying', 'running', 'blocked')";

/// A grouped job may be claimed when it is its group's head and its group
/// has nothing running: no job of the group is running, and it is the
/// group's oldest waiting job (enqueue order; a retrying job keeps its
/// place, a delayed one holds the jobs after it). The jobs behind a head are
/// normally `blocked`, outside the claim's index (migration `group_heads`);
/// this check orders the few that are not: jobs enqueued through the SQL
/// function, replayed dead jobs, and two inserts into an empty group at
/// once. The oldest is read in the order of `jobs_group_open`, which only
/// that index gives (a plan on the primary key cannot). Snapshots of
/// concurrent PostgreSQL claims can disagree on a group's head; the unique
/// index `jobs_group_running` refuses the second job of a group marked
/// running, and that claim runs again.
const GROUP_HEAD_FREE: &str = "NOT EXISTS (SELECT 1 FROM jobs g \
        WHERE g.group_key = jobs.group_key AND g.state = 'running') \
    AND jobs.id = (SELECT g.id FROM jobs g WHERE g.group_key = jobs.group_key \
        AND g.state IN ('available', 'retrying', 'running', 'blocked') \
        AND g.state IN ('available', 'retrying') \
        ORDER BY g.group_key, g.id LIMIT 1)";

/// The fence of a batched effect write against the row set `t`.
const EFFECT_FENCE: &str = "{effect_keys}effects.key = t.key AND effects.lease_owner = t.owner \
    AND effects.attempt = t.attempt AND {effect_processing}";

/// A reconcile answer's target: key `$1` at attempt `$2` (the attempt
/// read: every claim moves it), still unsettled and held by no live lease,
/// all re-checked on the row itself.
const UNSETTLED_AT_ATTEMPT: &str = "key = $1 AND attempt = $2 \
    AND (reached = 1 OR status = 'processing') AND status <> 'succeeded' \
    AND (status <> 'failed' OR in_doubt = 1) \
    AND (status <> 'processing' OR COALESCE(lease_until, 0) < {now})";

use ColType::{Bytes, Int, Text};

/// Columns of the job fence in a row set (first in every job row set).
const FENCE_COLS: [(&str, ColType); 3] = [("id", Int), ("owner", Text), ("attempt", Int)];
/// Columns of the effect fence in a row set.
const EFFECT_FENCE_COLS: [(&str, ColType); 3] = [("key", Text), ("owner", Text), ("attempt", Int)];

/// Columns of a job to insert, in row-set order.
pub(crate) const INSERT_COLS: [(&str, ColType); 9] = [
    ("queue", Text),
    ("plugin", Text),
    ("payload", Bytes),
    ("idem_key", Text),
    ("priority", Int),
    ("delay_ms", Int),
    ("max_attempts", Int),
    ("correlation_id", Text),
    ("group_key", Text),
];

/// The statements of one store, expanded for its dialect and clock.
pub(crate) struct Queries {
    pub job_insert: String,
    pub job_by_key: String,
    pub job_insert_dead: String,
    pub job_dead_error: String,
    pub job_insert_rows: String,
    pub job_insert_rows_unkeyed: String,
    pub group_open: String,
    pub group_next: String,
    pub groups_blocked: String,
    pub jobs_by_keys: String,
    pub job_get: String,
    pub job_list: String,
    pub job_claim: String,
    pub running_in_queue: String,
    pub job_heartbeat: String,
    pub job_save_plan: String,
    pub job_succeed: String,
    /// As `job_succeed`, but a job row another transaction has locked is
    /// left alone (no row returned) instead of waited for: the statement
    /// of a `sql` effect holds its ledger row while it marks its job, and
    /// a group-commit batch locks jobs before ledger rows, so waiting could
    /// close a deadlock cycle (PostgreSQL; SQLite has one writer).
    pub job_succeed_unless_locked: String,
    pub job_retry: String,
    pub job_dead: String,
    pub job_release: String,
    pub payloads_of: String,
    pub job_rescue: String,
    pub plans_of_dead: String,
    pub effects_reset_failed: String,
    pub jobs_replay: String,
    pub dead_plan: String,
    pub effects_in_doubt: String,
    pub effects_unresolved: String,
    pub effect_claim_fence: String,
    pub effect_resolve_applied: String,
    pub effect_resolve_not_applied: String,
    pub effects_to_reconcile: String,
    pub effect_reconcile_applied: String,
    pub effect_reconcile_not_applied: String,
    pub effect_ask_later: String,
    pub dead_jobs_settled: String,
    pub effects_drop_failed: String,
    pub plan_discard: String,
    pub job_cancel: String,
    pub job_state_locked: String,
    pub jobs_prune: String,
    pub dead_payloads: String,
    pub job_set_payload: String,
    pub effects_prune: String,
    pub stats_counts: String,
    pub stats_counts_queue: String,
    pub stats_ready: String,
    pub stats_ready_queue: String,
    pub stats_recent: String,
    pub stats_dead_codes: String,
    pub overview_counts: String,
    pub overview_ready: String,
    pub overview_recent: String,
    pub overview_dead_codes: String,
    pub effect_claim_fresh: String,
    pub effect_insert: String,
    pub effect_take_over: String,
    pub effect_read: String,
    pub effect_succeed: String,
    pub effect_fail: String,
    pub effect_set_ref: String,
    pub effect_keys_present: String,
    pub effect_owners: String,
    pub effect_insert_done: String,
    pub effect_delete_keys: String,
    pub effect_get: String,
    pub effect_list: String,
    pub clock_advance: String,
    pub clock_now: String,
    pub schedule_start: String,
    pub schedule_advance: String,
    pub schedule_set_job: String,
    pub schedule_list: String,
    pub session_insert: String,
    pub session_live: String,
    pub session_revoke: String,
    pub sessions_prune: String,
}

/// How `now` is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// The database clock (production).
    Database,
    /// The database clock plus an offset that tests move forward
    /// ([`super::Store::clock_advance`]) instead of sleeping.
    Adjustable,
}

impl Queries {
    /// Expands every statement for `dialect`.
    pub fn new(d: &Dialect, clock: Clock) -> Self {
        let now = match clock {
            Clock::Database => format!("({})", d.now),
            Clock::Adjustable => {
                format!(
                    "({} + (SELECT offset_ms FROM idem_clock WHERE id = 1))",
                    d.now
                )
            }
        };
        let keys = Keys {
            jobs: (d.row_keys)("jobs.id", Int),
            effects: (d.row_keys)("effects.key", Text),
            plain: (d.row_keys)("key", Text),
        };
        let x = |text: &str| expand(d, &keys, &now, text);
        // A row set of new jobs, in input order, ended by `tail`.
        let insert_rows = |tail: &str| {
            x(&format!(
                "INSERT INTO jobs (queue, plugin, payload, idempotency_key, priority, run_at, \
                     state, max_attempts, correlation_id, group_key, created_at, updated_at) \
                 SELECT t.queue, t.plugin, t.payload, t.idem_key, t.priority, {{now}} + t.delay_ms, \
                     CASE WHEN t.group_key IS NULL THEN 'available' ELSE 'blocked' END, \
                     t.max_attempts, t.correlation_id, t.group_key, {{now}}, {{now}} \
                 FROM {rows} WHERE true ORDER BY t.ord {tail}",
                rows = (d.rows)(&INSERT_COLS),
            ))
        };
        let record_error = |cond: &str, record: &str, code: &str, message: &str| {
            format!(
                "errors = CASE WHEN {cond} THEN {appended} ELSE errors END, \
                 last_error_code = CASE WHEN {cond} THEN {code} ELSE last_error_code END, \
                 last_error_message = CASE WHEN {cond} THEN {message} ELSE last_error_message END, \
                 first_failed_at = CASE WHEN {cond} THEN COALESCE(first_failed_at, {{now}}) ELSE first_failed_at END, \
                 last_failed_at = CASE WHEN {cond} THEN {{now}} ELSE last_failed_at END",
                appended = (d.append_error)(record, "{now}", ERROR_HISTORY),
            )
        };
        // The error a retry or a dead-lettering carries, when it carries one.
        let job_error = record_error(
            "t.record IS NOT NULL",
            &(d.json_param)("t.record"),
            "t.code",
            "t.message",
        );
        let job_rows = |extra: &[(&'static str, ColType)]| {
            let cols: Vec<(&str, ColType)> = FENCE_COLS.iter().chain(extra).copied().collect();
            (d.rows)(&cols)
        };
        // A job's success, fenced; `extra` narrows the rows it may mark.
        let job_succeed = |extra: &str| {
            x(&format!(
                "UPDATE jobs SET state = 'succeeded', finished_at = {{now}}, lease_owner = NULL, \
                     lease_until = NULL, plugin_hash = COALESCE(t.hash, jobs.plugin_hash), \
                     plan = COALESCE(jobs.plan, t.plan), \
                     plan_hash = CASE WHEN jobs.plan IS NULL AND t.plan IS NOT NULL \
                         THEN t.hash ELSE jobs.plan_hash END, \
                     updated_at = {{now}} \
                 FROM {rows} WHERE {JOB_FENCE} {extra} RETURNING jobs.id, jobs.group_key",
                rows = job_rows(&[("hash", Text), ("plan", Text)]),
            ))
        };
        let effect_rows = |extra: &[(&'static str, ColType)]| {
            let cols: Vec<(&str, ColType)> =
                EFFECT_FENCE_COLS.iter().chain(extra).copied().collect();
            (d.rows)(&cols)
        };
        // A rescue of an attempt that started charges it (dead once the
        // attempts are used up, `lease_expired`); one of a claim that never
        // started gives it back (dead at the bound, `rescued_unstarted`).
        let lease_expired = Code::LeaseExpired.as_str();
        let rescued_unstarted = Code::RescuedUnstarted.as_str();
        let dead = format!(
            "((started = 0 AND unstarted_rescues + 1 >= {MAX_UNSTARTED_RESCUES}) \
              OR (started <> 0 AND attempt >= max_attempts))"
        );
        let refund = format!("(started = 0 AND unstarted_rescues + 1 < {MAX_UNSTARTED_RESCUES})");
        let rescue_code = format!(
            "(CASE WHEN started = 0 THEN '{rescued_unstarted}' ELSE '{lease_expired}' END)"
        );
        let rescue_message = format!(
            "(CASE WHEN started = 0 THEN 'rescued {MAX_UNSTARTED_RESCUES} times before its start \
              was recorded: the host stops before or just after this job starts' \
              ELSE 'the lease expired before the attempt finished' END)"
        );
        let rescue_record = (d.json_object)(&format!(
            "'attempt', attempt, 'class', 'ambiguous', 'code', {rescue_code}, \
             'message', {rescue_message}, 'at_ms', 0"
        ));
        Queries {
            job_insert: x(
                "INSERT INTO jobs (queue, plugin, payload, idempotency_key, priority, \
                     run_at, state, max_attempts, correlation_id, group_key, created_at, \
                     updated_at) \
                 VALUES ($1, $2, $3, $4, $5, {now} + $6, \
                     CASE WHEN $9 IS NOT NULL AND $10 = 1 THEN 'blocked' ELSE 'available' END, \
                     $7, $8, $9, {now}, {now}) \
                 ON CONFLICT {key_conflict} DO NOTHING \
                 RETURNING id",
            ),
            job_by_key: x("SELECT id FROM jobs WHERE plugin = $1 AND idempotency_key = $2"),
            // Dead on arrival: a message that cannot become a runnable job
            // is kept, dead, with its error, for an operator.
            job_insert_dead: x(
                "INSERT INTO jobs (queue, plugin, payload, idempotency_key, priority, run_at, \
                     state, max_attempts, correlation_id, created_at, updated_at, finished_at, \
                     group_key) \
                 VALUES ($1, $2, $3, $6, 0, {now}, 'dead', $4, $5, {now}, {now}, {now}, $7) \
                 ON CONFLICT {key_conflict} DO NOTHING RETURNING id",
            ),
            job_dead_error: x(&format!(
                "UPDATE jobs SET {record} WHERE id = $1",
                record = record_error("true", &(d.json_param)("$2"), "$3", "$4"),
            )),
            job_insert_rows: insert_rows(
                "ON CONFLICT {key_conflict} DO NOTHING RETURNING id, plugin, idempotency_key",
            ),
            // A row set without keys cannot conflict: a plain insert, which
            // PostgreSQL runs ~15% faster than one that checks the key
            // index for every row (a speculative insertion), and only ids
            // come back.
            job_insert_rows_unkeyed: insert_rows("RETURNING id"),
            // Grouped jobs are inserted `blocked`; this makes the oldest
            // of each group's new jobs (ids `$1`) its head unless an older
            // open job of the group is there to end first. That job is
            // share-locked until this transaction commits, so it cannot end
            // (and find no job to promote) before the new ones are visible;
            // a job being written now is skipped (its writer may be ending
            // it) and the next older one taken. Nothing found: the group is
            // empty, and the oldest new job is its head.
            group_open: x(&format!(
                "UPDATE jobs SET state = 'available', updated_at = {{now}} \
                 WHERE state = 'blocked' \
                   AND {picked} \
                   AND NOT EXISTS (SELECT 1 FROM jobs o \
                       WHERE o.group_key = jobs.group_key AND o.{GROUP_OPEN} \
                         AND o.id NOT IN ({ids}) \
                       ORDER BY o.group_key DESC, o.id DESC LIMIT 1 {{share_skip_locked}})",
                ids = (d.int_list)("$1"),
                picked = (d.ids_in)(
                    "id",
                    &format!(
                        "SELECT min(n.id) FROM jobs n WHERE n.id IN ({ids}) GROUP BY n.group_key",
                        ids = (d.int_list)("$1"),
                    )
                ),
            )),
            // Which of the groups `$1` still have a blocked job.
            groups_blocked: x(&format!(
                "SELECT gs.value FROM ({groups}) AS gs \
                 WHERE EXISTS (SELECT 1 FROM jobs b WHERE b.group_key = gs.value \
                     AND b.{GROUP_OPEN} AND b.state = 'blocked')",
                groups = (d.text_list)("$1"),
            )),
            // The groups `$1` lost a live job (succeeded, dead, cancelled):
            // the oldest blocked job of each becomes its head. Read in the
            // order of `jobs_group_open`, so a hot group costs one step, not
            // a scan of its backlog. A job another transaction changed
            // meanwhile (cancelled, promoted) is re-checked and left alone;
            // the caller tries again for the groups it promoted nothing in
            // (`group_next!`).
            group_next: x(&format!(
                "UPDATE jobs SET state = 'available', updated_at = {{now}} \
                 WHERE state = 'blocked' AND {picked} RETURNING group_key",
                picked = (d.ids_in)(
                    "id",
                    &format!(
                        "SELECT (SELECT b.id FROM jobs b \
                                 WHERE b.group_key = gs.value AND b.{GROUP_OPEN} \
                                   AND b.state = 'blocked' \
                                 ORDER BY b.group_key, b.id LIMIT 1) \
                         FROM ({groups}) AS gs",
                        groups = (d.text_list)("$1"),
                    )
                ),
            )),
            jobs_by_keys: x(&format!(
                "SELECT id, plugin, idempotency_key FROM jobs \
                 WHERE (plugin, idempotency_key) IN (SELECT t.plugin, t.idem_key FROM {rows})",
                rows = (d.rows)(&[("plugin", Text), ("idem_key", Text)]),
            )),
            job_get: x("SELECT {job_cols} FROM jobs WHERE id = $1"),
            // Filters are `$N IS NULL OR ...`; state names are inlined by the
            // caller so the partial indexes match.
            job_list: x(&format!(
                "SELECT {{job_cols}} FROM jobs WHERE {{states}} \
                   AND ($1 IS NULL OR plugin = $1) \
                   AND ($2 IS NULL OR last_error_code = $2) \
                   AND ($3 IS NULL OR id IN ({ids})) \
                   AND ($5 IS NULL OR queue = $5) \
                   AND ($6 IS NULL OR id < $6) \
                 ORDER BY id DESC LIMIT $4",
                ids = (d.int_list)("$3"),
            )),
            // A job enqueued without attempts (NULL) gets them here, once:
            // its plugin's ($5, a JSON object by plugin name), else the
            // worker's default ($6).
            job_claim: x(&format!(
                "UPDATE jobs SET state = 'running', attempt = attempt + 1, lease_owner = $1, \
                     lease_until = {{now}} + $2, heartbeat_at = {{now}}, started = 0, \
                     updated_at = {{now}}, \
                     max_attempts = COALESCE(jobs.max_attempts, {plugin_attempts}, $6) \
                 WHERE {picked} \
                 RETURNING {{job_cols}}",
                plugin_attempts = (d.json_int_at)("$5", "jobs.plugin"),
                picked = (d.ids_in)(
                    "id",
                    &format!(
                        "SELECT id FROM jobs \
                         WHERE queue = $3 AND state IN ('available', 'retrying') \
                           AND run_at <= {{now}} AND (group_key IS NULL OR ({GROUP_HEAD_FREE})) \
                         ORDER BY priority DESC, run_at, id \
                         LIMIT $4 {{skip_locked}}"
                    )
                ),
            )),
            running_in_queue: x("SELECT count(*) FROM jobs WHERE state = 'running' AND queue = $1"),
            job_heartbeat: x(&format!(
                "UPDATE jobs SET lease_until = {{now}} + t.lease, heartbeat_at = {{now}}, \
                     started = {{greatest}}(jobs.started, t.started), updated_at = {{now}} \
                 FROM {rows} WHERE {JOB_FENCE} RETURNING jobs.id",
                rows = job_rows(&[("lease", Int), ("started", Int)]),
            )),
            // A redelivered job keeps its first plan.
            job_save_plan: x(&format!(
                "UPDATE jobs SET plan = COALESCE(jobs.plan, t.plan), \
                     plan_hash = CASE WHEN jobs.plan IS NULL THEN t.hash ELSE jobs.plan_hash END, \
                     plugin_hash = t.hash, started = 1, updated_at = {{now}} \
                 FROM {rows} WHERE {JOB_FENCE} RETURNING jobs.id",
                rows = job_rows(&[("plan", Text), ("hash", Text)]),
            )),
            job_succeed: job_succeed(""),
            job_succeed_unless_locked: job_succeed(
                "AND jobs.id IN (SELECT free.id FROM jobs free WHERE free.id = t.id {skip_locked})",
            ),
            job_retry: x(&format!(
                "UPDATE jobs SET state = 'retrying', run_at = {{now}} + t.delay_ms, \
                     attempt = {{greatest}}(jobs.attempt - t.refund, 0), lease_owner = NULL, \
                     deferred_since = CASE WHEN t.refund = 1 \
                         THEN COALESCE(jobs.deferred_since, {{now}}) ELSE NULL END, \
                     lease_until = NULL, plugin_hash = COALESCE(t.hash, jobs.plugin_hash), \
                     {record}, updated_at = {{now}} \
                 FROM {rows} WHERE {JOB_FENCE} RETURNING jobs.id",
                record = job_error,
                rows = job_rows(&[
                    ("delay_ms", Int),
                    ("refund", Int),
                    ("hash", Text),
                    ("record", Text),
                    ("code", Text),
                    ("message", Text),
                ]),
            )),
            job_dead: x(&format!(
                "UPDATE jobs SET state = 'dead', finished_at = {{now}}, lease_owner = NULL, \
                     lease_until = NULL, payload = COALESCE(t.payload, jobs.payload), \
                     plugin_hash = COALESCE(t.hash, jobs.plugin_hash), {record}, \
                     updated_at = {{now}} \
                 FROM {rows} WHERE {JOB_FENCE} RETURNING jobs.id, jobs.group_key",
                record = job_error,
                rows = job_rows(&[
                    ("payload", Bytes),
                    ("hash", Text),
                    ("record", Text),
                    ("code", Text),
                    ("message", Text),
                ]),
            )),
            job_release: x(&format!(
                "UPDATE jobs SET state = 'available', run_at = {{now}}, lease_owner = NULL, \
                     lease_until = NULL, attempt = {{greatest}}(jobs.attempt - 1, 0), \
                     interruptions = jobs.interruptions + 1, updated_at = {{now}} \
                 FROM {rows} WHERE {JOB_FENCE} RETURNING jobs.id",
                rows = job_rows(&[]),
            )),
            payloads_of: x(&format!(
                "SELECT id, payload FROM jobs WHERE id IN ({ids})",
                ids = (d.int_list)("$1"),
            )),
            // The conditions that pick the rows are repeated outside the
            // subquery: a job that finished, or was claimed again, while
            // this statement waited for its lock is left alone (see
            // `Dialect::ids_in`). Locked rows are skipped: their holder is
            // writing them now, and the next rescue sees them.
            job_rescue: x(&format!(
                "UPDATE jobs SET \
                     state = CASE WHEN {dead} THEN 'dead' ELSE 'available' END, \
                     run_at = CASE WHEN {dead} THEN run_at ELSE {{now}} END, \
                     finished_at = CASE WHEN {dead} THEN {{now}} ELSE NULL END, \
                     attempt = CASE WHEN {refund} THEN {{greatest}}(attempt - 1, 0) \
                         ELSE attempt END, \
                     unstarted_rescues = unstarted_rescues \
                         + CASE WHEN started = 0 THEN 1 ELSE 0 END, \
                     rescues = rescues + 1, lease_owner = NULL, lease_until = NULL, \
                     {record}, updated_at = {{now}} \
                 WHERE {picked} AND state = 'running' AND lease_until < {{now}} \
                 RETURNING id, state, group_key",
                picked = (d.ids_in)(
                    "id",
                    "SELECT id FROM jobs WHERE state = 'running' AND lease_until < {now} \
                     ORDER BY lease_until LIMIT $1 {skip_locked}"
                ),
                record = record_error(&dead, &rescue_record, &rescue_code, &rescue_message),
            )),
            plans_of_dead: x(&format!(
                "SELECT id, plan FROM jobs WHERE state = 'dead' AND id IN ({ids})",
                ids = (d.int_list)("$1"),
            )),
            // Effects of replayed plans that failed permanently may be tried
            // again: the operator fixed the cause. Their keys stay the same.
            effects_reset_failed: x(&format!(
                "UPDATE effects SET status = 'retrying', updated_at = {{now}} \
                 WHERE status = 'failed' AND in_doubt = 0 AND key IN ({keys})",
                keys = (d.text_list)("$1"),
            )),
            jobs_replay: x(&format!(
                "UPDATE jobs SET state = 'available', attempt = 0, unstarted_rescues = 0, \
                     run_at = {{now}}, finished_at = NULL, lease_owner = NULL, lease_until = NULL, \
                     deferred_since = NULL, \
                     updated_at = {{now}} \
                 WHERE state = 'dead' AND id IN ({ids})",
                ids = (d.int_list)("$1"),
            )),
            dead_plan: x("SELECT plan, payload FROM jobs WHERE id = $1 AND state = 'dead'"),
            // Ledger rows of a plan that may have reached the outside world:
            // anything but a permanent failure, and a row any try of which
            // may have been carried out (sticky, whatever the last error).
            effects_in_doubt: x(&format!(
                "SELECT count(*) FROM effects \
                 WHERE (status <> 'failed' OR reached = 1 OR in_doubt = 1) AND key IN ({keys})",
                keys = (d.text_list)("$1"),
            )),
            effects_unresolved: x(&format!(
                "SELECT key FROM effects WHERE in_doubt = 1 AND key IN ({keys}) ORDER BY key",
                keys = (d.text_list)("$1"),
            )),
            // Which claimers still hold their job at their attempt; on
            // PostgreSQL the rows stay locked until the claims commit, so a
            // rescue cannot slip in between.
            effect_claim_fence: x(&format!(
                "SELECT jobs.id, jobs.lease_owner, jobs.attempt FROM jobs, {rows} \
                 WHERE {{job_ids}}jobs.id = t.job_id AND {{claimer_running}} \
                   AND jobs.lease_owner = t.owner AND jobs.attempt = t.attempt {{lock_jobs}}",
                rows = (d.rows)(&[("job_id", Int), ("owner", Text), ("attempt", Int)]),
            )),
            effect_resolve_applied: x(
                "UPDATE effects SET status = 'succeeded', result_ref = COALESCE($2, result_ref), \
                     reached = 1, in_doubt = 0, lease_owner = NULL, lease_until = NULL, \
                     updated_at = {now} \
                 WHERE key = $1 AND in_doubt = 1",
            ),
            // The operator's word replaces every earlier try: nothing reached
            // the provider, and a new dedupe window starts with the next try.
            effect_resolve_not_applied: x(
                "UPDATE effects SET status = 'retrying', reached = 0, in_doubt = 0, \
                     first_sent_at = NULL, lease_owner = NULL, lease_until = NULL, \
                     updated_at = {now} \
                 WHERE key = $1 AND in_doubt = 1",
            ),
            // Keys whose outcome is unknown and that no live lease holds,
            // of the providers that can be asked ($1), optionally of one
            // plugin ($2, '' for all): a try may have reached the provider
            // and nothing settled it since (marked reached, or left
            // `processing` by a holder whose lease ran out mid-call).
            // Oldest try first.
            effects_to_reconcile: x(&format!(
                "SELECT key, attempt, provider, plugin, fingerprint, job_id, \
                     {{now}} - COALESCE(try_at, updated_at) AS tried_ago \
                 FROM effects \
                 WHERE (reached = 1 OR status = 'processing') AND status <> 'succeeded' \
                   AND (status <> 'failed' OR in_doubt = 1) \
                   AND (status <> 'processing' OR COALESCE(lease_until, 0) < {{now}}) \
                   AND COALESCE(ask_after, 0) <= {{now}} \
                   AND provider IN ({providers}) AND ($2 = '' OR plugin = $2) \
                 ORDER BY COALESCE(try_at, updated_at), key LIMIT $3",
                providers = (d.text_list)("$1"),
            )),
            // A lookup's answer, fenced by the attempt read with the row
            // (every claim moves it) and re-checked on the row itself: a
            // key claimed or settled meanwhile is left alone.
            effect_reconcile_applied: x(&format!(
                "UPDATE effects SET status = 'succeeded', result_ref = COALESCE($3, result_ref), \
                     reached = 1, in_doubt = 0, lease_owner = NULL, lease_until = NULL, \
                     updated_at = {{now}} \
                 WHERE {UNSETTLED_AT_ATTEMPT}"
            )),
            // As `effect_resolve_not_applied`: no earlier try reached the
            // provider, so the next try is a first one.
            effect_reconcile_not_applied: x(&format!(
                "UPDATE effects SET status = 'retrying', reached = 0, in_doubt = 0, \
                     first_sent_at = NULL, lease_owner = NULL, lease_until = NULL, \
                     updated_at = {{now}} \
                 WHERE {UNSETTLED_AT_ATTEMPT}"
            )),
            // The sweep leaves a key it could not settle until `$3` ms from
            // now (fenced by the attempt read: a claim moves it on).
            effect_ask_later: x(
                "UPDATE effects SET ask_after = {now} + $3 WHERE key = $1 AND attempt = $2",
            ),
            // Dead jobs ($1: codes) held back only by effects in doubt: one
            // of their ledger rows is at a provider that can be asked ($2),
            // none is still unsettled (held, marked reached and not settled,
            // or left for an operator). A page after id $4, of plugin $3
            // ('' for all); the caller checks every key of the plan.
            dead_jobs_settled: x(&format!(
                "SELECT jobs.id FROM jobs \
                 WHERE jobs.state = 'dead' AND jobs.last_error_code IN ({codes}) \
                   AND ($3 = '' OR jobs.plugin = $3) AND jobs.id > $4 \
                   AND EXISTS (SELECT 1 FROM effects WHERE effects.job_id = jobs.id \
                       AND effects.provider IN ({providers})) \
                   AND NOT EXISTS (SELECT 1 FROM effects WHERE effects.job_id = jobs.id \
                       AND (effects.in_doubt = 1 OR effects.status = 'processing' \
                            OR (effects.reached = 1 AND effects.status = 'retrying'))) \
                 ORDER BY jobs.id LIMIT $5",
                codes = (d.text_list)("$1"),
                providers = (d.text_list)("$2"),
            )),
            effects_drop_failed: x(&format!(
                "DELETE FROM effects WHERE status = 'failed' AND job_id = $2 AND key IN ({keys})",
                keys = (d.text_list)("$1"),
            )),
            plan_discard: x(
                "UPDATE jobs SET plan = NULL, plan_hash = NULL, updated_at = {now} \
                 WHERE id = $1 AND state = 'dead'",
            ),
            // A waiting job, blocked behind its group or not.
            job_cancel: x("UPDATE jobs SET state = 'cancelled', finished_at = {now}, \
                     updated_at = {now} \
                 WHERE id = $1 AND state IN ('available', 'retrying', 'blocked')"),
            // A job's state and group, locked until the transaction ends.
            job_state_locked: x("SELECT state, group_key FROM jobs WHERE id = $1 {for_update}"),
            // `$3` is the smaller retention, so the index on finished_at
            // bounds the scan.
            // The conditions are repeated outside the subquery, so a row
            // that changed while this statement waited is left alone (see
            // `Dialect::ids_in`).
            jobs_prune: x(&format!(
                "DELETE FROM jobs WHERE {picked} \
                   AND ((state IN ('succeeded', 'cancelled') AND finished_at < {{now}} - $1) \
                        OR (state = 'dead' AND finished_at < {{now}} - $2))",
                picked = (d.ids_in)(
                    "id",
                    "SELECT id FROM jobs \
                     WHERE state IN ('succeeded', 'dead', 'cancelled') \
                       AND finished_at < {now} - $3 \
                       AND ((state IN ('succeeded', 'cancelled') AND finished_at < {now} - $1) \
                            OR (state = 'dead' AND finished_at < {now} - $2)) \
                     ORDER BY finished_at LIMIT $4 {skip_locked}"
                ),
            )),
            dead_payloads: x(&format!(
                "SELECT id, payload FROM jobs WHERE state = 'dead' AND id IN ({ids})",
                ids = (d.int_list)("$1"),
            )),
            job_set_payload: x(
                "UPDATE jobs SET payload = $2, updated_at = {now} WHERE id = $1 AND state = 'dead'",
            ),
            // As `jobs_prune`: a row taken over (`processing`) or touched
            // while this statement waited is left alone. The job check is
            // repeated too: a replay that made the job runnable again
            // keeps its ledger.
            effects_prune: x(&format!(
                "DELETE FROM effects WHERE {picked} \
                   AND status <> 'processing' AND updated_at < {{now}} - $1 \
                   AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.id = effects.job_id \
                                   AND jobs.state <> 'succeeded')",
                picked = (d.ids_in)(
                    "key",
                    "SELECT key FROM effects \
                     WHERE status <> 'processing' AND updated_at < {now} - $1 \
                       AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.id = effects.job_id \
                                       AND jobs.state <> 'succeeded') \
                     ORDER BY updated_at LIMIT $2 {skip_locked}"
                ),
            )),
            stats_counts: x(&counts_by_state("", "")),
            stats_counts_queue: x(&counts_by_state("AND queue = $1", "")),
            stats_ready: x(
                "SELECT count(*) AS n, {now} - min(run_at) AS age FROM jobs \
                 WHERE state IN ('available', 'retrying') AND run_at <= {now}",
            ),
            stats_ready_queue: x(
                "SELECT count(*) AS n, {now} - min(run_at) AS age FROM jobs \
                 WHERE queue = $1 AND state IN ('available', 'retrying') AND run_at <= {now}",
            ),
            // The state list repeats the partial index's predicate exactly,
            // so both databases read the last minute from `jobs_finished`.
            stats_recent: x("SELECT state, count(*) AS n FROM jobs \
                 WHERE state IN ('succeeded', 'dead', 'cancelled') \
                   AND finished_at >= {now} - 60000 AND ($1 IS NULL OR queue = $1) GROUP BY state"),
            stats_dead_codes: x(
                "SELECT COALESCE(last_error_code, '-') AS code, count(*) AS n FROM jobs \
                 WHERE state = 'dead' AND ($1 IS NULL OR queue = $1) \
                 GROUP BY COALESCE(last_error_code, '-')",
            ),
            overview_counts: x(&format!("{} ORDER BY queue", counts_by_state("", "queue,"))),
            overview_ready: x(
                "SELECT queue, count(*) AS n, {now} - min(run_at) AS age FROM jobs \
                 WHERE state IN ('available', 'retrying') AND run_at <= {now} GROUP BY queue",
            ),
            overview_recent: x("SELECT queue, state, count(*) AS n FROM jobs \
                 WHERE state IN ('succeeded', 'dead', 'cancelled') AND finished_at >= {now} - 60000 \
                 GROUP BY queue, state"),
            overview_dead_codes: x(
                "SELECT queue, COALESCE(last_error_code, '-') AS code, count(*) AS n FROM jobs \
                 WHERE state = 'dead' GROUP BY queue, COALESCE(last_error_code, '-')",
            ),
            // The common claim in one statement (one round trip of a flush
            // instead of three): the claimer still holds its job at its
            // attempt (rows locked until the claim commits on PostgreSQL,
            // as `effect_claim_fence`), the key's older-release form has no
            // row (any row sends the claim to `effect_owners`, which checks
            // whose it is), and the key has no row. A claim not inserted
            // takes the full path; it learns there which of the three
            // stopped it. Rows go in key order (keys are distinct), so two
            // transactions claiming overlapping keys wait for each other
            // instead of deadlocking.
            effect_claim_fresh: x(&format!(
                "WITH held AS (SELECT jobs.id, jobs.lease_owner, jobs.attempt FROM jobs, {rows} \
                     WHERE {picked} AND jobs.id = t.job_id AND {{claimer_running}} \
                       AND jobs.lease_owner = t.owner AND jobs.attempt = t.job_attempt \
                     {{lock_jobs}}) \
                 INSERT INTO effects (key, job_id, plugin, provider, fingerprint, status, attempt, \
                     lease_owner, lease_until, created_at, updated_at, first_sent_at, \
                     claim_job, claim_attempt, try_at) \
                 SELECT t.key, t.job_id, t.plugin, t.provider, t.fingerprint, 'processing', 1, \
                     t.owner, {{now}} + t.lease, {{now}}, {{now}}, {{now}}, t.job_id, t.job_attempt, \
                     {{now}} \
                 FROM {rows} \
                 WHERE EXISTS (SELECT 1 FROM held WHERE held.id = t.job_id \
                         AND held.lease_owner = t.owner AND held.attempt = t.job_attempt) \
                   AND NOT EXISTS (SELECT 1 FROM effects older WHERE older.key = t.older_key) \
                 ORDER BY t.key \
                 ON CONFLICT (key) DO NOTHING RETURNING key, attempt",
                rows = (d.rows)(&FRESH_CLAIM_COLS),
                picked = (d.ids_in)(
                    "jobs.id",
                    &format!("SELECT t.job_id FROM {}", (d.rows)(&FRESH_CLAIM_COLS))
                ),
            )),
            // Rows go in key order (keys are distinct within a round), so
            // two transactions claiming overlapping keys wait for each
            // other instead of deadlocking.
            effect_insert: x(&format!(
                "INSERT INTO effects (key, job_id, plugin, provider, fingerprint, status, attempt, \
                     lease_owner, lease_until, created_at, updated_at, first_sent_at, \
                     claim_job, claim_attempt, try_at) \
                 SELECT t.key, t.job_id, t.plugin, t.provider, t.fingerprint, 'processing', 1, \
                     t.owner, {{now}} + t.lease, {{now}}, {{now}}, {{now}}, t.job_id, t.job_attempt, \
                     {{now}} \
                 FROM {rows} WHERE true ORDER BY t.key \
                 ON CONFLICT (key) DO NOTHING RETURNING key, attempt",
                rows = (d.rows)(&CLAIM_COLS),
            )),
            // A row left `processing` by an expired lease, or `retrying`,
            // is taken over by a conditional update. A `processing` row's
            // holder vanished mid-call: its try may have reached the
            // provider, so the row is marked reached, and the claimer learns
            // from `reached` that the outcome so far is unknown. A
            // `processing` row of this very claim (same job, attempt and
            // lease owner: its insert committed but the batch answered an
            // error, and the claimer asks again) was never sent: it is the
            // same claim, taken again without a mark.
            effect_take_over: x(&format!(
                "UPDATE effects SET status = 'processing', attempt = effects.attempt + 1, \
                     lease_owner = t.owner, lease_until = {{now}} + t.lease, updated_at = {{now}}, \
                     reached = CASE WHEN effects.status = 'processing' AND NOT {same} THEN 1 \
                         ELSE effects.reached END, \
                     claim_job = t.job_id, claim_attempt = t.job_attempt, \
                     first_sent_at = COALESCE(effects.first_sent_at, {{now}}), \
                     prior_try_at = COALESCE(effects.try_at, effects.updated_at), \
                     try_at = {{now}}, ask_after = NULL \
                 FROM {rows} \
                 WHERE {{effect_keys}}effects.key = t.key AND effects.fingerprint = t.fingerprint \
                   AND effects.status NOT IN ('succeeded', 'failed') \
                   AND (effects.status <> 'processing' \
                        OR COALESCE(effects.lease_until, 0) < {{now}} OR {same}) \
                 RETURNING effects.key, effects.attempt, effects.reached, \
                     {{now}} - effects.first_sent_at AS sent_ago, \
                     {{now}} - effects.prior_try_at AS tried_ago",
                rows = (d.rows)(&CLAIM_COLS),
                same = "(effects.claim_job = t.job_id AND effects.claim_attempt = t.job_attempt \
                         AND effects.lease_owner = t.owner)",
            )),
            effect_read: x(&format!(
                "SELECT key, fingerprint, status, lease_until, result_ref, last_error_code, \
                     {{now}} AS now \
                 FROM effects WHERE {{row_keys}}key IN (SELECT t.key FROM {rows})",
                rows = (d.rows)(&[("key", Text)]),
            )),
            effect_succeed: x(&format!(
                "UPDATE effects SET status = 'succeeded', result_ref = t.result_ref, \
                     reached = 1, in_doubt = 0, \
                     lease_owner = NULL, lease_until = NULL, updated_at = {{now}} \
                 FROM {rows} WHERE {EFFECT_FENCE} RETURNING effects.key",
                rows = effect_rows(&[("result_ref", Text)]),
            )),
            effect_fail: x(&format!(
                "UPDATE effects SET status = t.status, last_error_code = t.code, \
                     last_error_at = {{now}}, lease_owner = NULL, lease_until = NULL, \
                     reached = {{greatest}}(effects.reached, t.reached), in_doubt = t.in_doubt, \
                     try_at = CASE WHEN t.called = 0 \
                         THEN COALESCE(effects.prior_try_at, effects.try_at) ELSE effects.try_at END, \
                     updated_at = {{now}} \
                 FROM {rows} WHERE {EFFECT_FENCE} RETURNING effects.key",
                rows = effect_rows(&[
                    ("status", Text),
                    ("code", Text),
                    ("reached", Int),
                    ("in_doubt", Int),
                    ("called", Int)
                ]),
            )),
            effect_set_ref: x(&format!(
                "UPDATE effects SET result_ref = t.result_ref FROM {rows} \
                 WHERE {{effect_keys}}effects.key = t.key AND {{effect_succeeded}}",
                rows = (d.rows)(&[("key", Text), ("result_ref", Text)]),
            )),
            effect_keys_present: x(&format!(
                "SELECT key FROM effects WHERE {{row_keys}}key IN (SELECT t.key FROM {rows})",
                rows = (d.rows)(&[("key", Text)]),
            )),
            // Which of these keys have rows, with whose request: the older-
            // release probe of a claim (`OlderKey`).
            effect_owners: x(&format!(
                "SELECT key, plugin, fingerprint FROM effects \
                 WHERE {{row_keys}}key IN (SELECT t.key FROM {rows})",
                rows = (d.rows)(&[("key", Text)]),
            )),
            // A `jobs` effect finished with its job in one write: its row is
            // born succeeded (the child's id is set once it is inserted).
            // Rows go in key order, so two nodes finishing overlapping keys
            // wait for each other instead of deadlocking.
            effect_insert_done: x(&format!(
                "INSERT INTO effects (key, job_id, plugin, provider, fingerprint, status, attempt, \
                     created_at, updated_at, first_sent_at, reached) \
                 SELECT t.key, t.job_id, t.plugin, t.provider, t.fingerprint, 'succeeded', 1, \
                     {{now}}, {{now}}, {{now}}, 1 \
                 FROM {rows} WHERE true ORDER BY t.key \
                 ON CONFLICT (key) DO NOTHING RETURNING key",
                rows = (d.rows)(&DONE_COLS),
            )),
            effect_delete_keys: x(&format!(
                "DELETE FROM effects WHERE {{row_keys}}key IN (SELECT t.key FROM {rows})",
                rows = (d.rows)(&[("key", Text)]),
            )),
            effect_get: x("SELECT {effect_cols} FROM effects WHERE key = $1"),
            effect_list: x(
                "SELECT {effect_cols} FROM effects WHERE job_id = $1 ORDER BY created_at, key",
            ),
            clock_advance: x("UPDATE idem_clock SET offset_ms = offset_ms + $1 WHERE id = 1"),
            clock_now: x("SELECT {now}"),
            schedule_start: x(
                "INSERT INTO schedules (name, last_tick_ms, last_job_id, updated_at) \
                 VALUES ($1, $2, NULL, {now}) ON CONFLICT (name) DO NOTHING",
            ),
            // The one statement two nodes race on: the loser's upsert waits
            // for the winner's row (its insert or its update), then finds
            // the tick no longer newer and returns no row. On PostgreSQL's
            // READ COMMITTED, ON CONFLICT DO UPDATE re-checks its WHERE on
            // the latest committed row, which is what makes this safe.
            schedule_advance: x(
                "INSERT INTO schedules (name, last_tick_ms, last_job_id, updated_at) \
                 VALUES ($1, $2, NULL, {now}) \
                 ON CONFLICT (name) DO UPDATE SET last_tick_ms = excluded.last_tick_ms, \
                     updated_at = excluded.updated_at \
                 WHERE schedules.last_tick_ms < excluded.last_tick_ms \
                 RETURNING name",
            ),
            schedule_set_job: x(
                "UPDATE schedules SET last_job_id = $2, updated_at = {now} WHERE name = $1",
            ),
            schedule_list: x(
                "SELECT s.name, s.last_tick_ms, s.last_job_id, s.updated_at, j.state AS last_job_state \
                 FROM schedules s LEFT JOIN jobs j ON j.id = s.last_job_id ORDER BY s.name",
            ),
            session_insert: x(&format!(
                "INSERT INTO sessions (id_digest, token_fingerprint, created_at, expires_at) \
                 VALUES ($1, $2, {{now}}, {{now}} + $3) RETURNING {SESSION_COLS}"
            )),
            session_live: x(&format!(
                "SELECT {SESSION_COLS} FROM sessions \
                 WHERE id_digest = $1 AND revoked_at IS NULL AND expires_at > {{now}} \
                   AND token_fingerprint IN ({fingerprints})",
                fingerprints = (d.text_list)("$2"),
            )),
            session_revoke: x(
                "UPDATE sessions SET revoked_at = {now} WHERE id_digest = $1 AND revoked_at IS NULL",
            ),
            // The expiry checked again outside the subquery (READ COMMITTED
            // re-checks only the target row's own conditions).
            sessions_prune: x(
                "DELETE FROM sessions WHERE expires_at <= {now} AND id_digest IN \
                 (SELECT id_digest FROM sessions WHERE expires_at <= {now} LIMIT $1)",
            ),
        }
    }
}

/// Columns of an effect claim, in row-set order.
pub(crate) const CLAIM_COLS: [(&str, ColType); 8] = [
    ("key", Text),
    ("job_id", Int),
    ("plugin", Text),
    ("provider", Text),
    ("fingerprint", Text),
    ("owner", Text),
    ("lease", Int),
    ("job_attempt", Int),
];

/// Columns of a claim on the one-statement path (`effect_claim_fresh`):
/// [`CLAIM_COLS`] and the key's older-release form, if it has one.
pub(crate) const FRESH_CLAIM_COLS: [(&str, ColType); 9] = [
    ("key", Text),
    ("job_id", Int),
    ("plugin", Text),
    ("provider", Text),
    ("fingerprint", Text),
    ("owner", Text),
    ("lease", Int),
    ("job_attempt", Int),
    ("older_key", Text),
];

/// Columns of a ledger row written as succeeded, in row-set order.
pub(crate) const DONE_COLS: [(&str, ColType); 5] = [
    ("key", Text),
    ("job_id", Int),
    ("plugin", Text),
    ("provider", Text),
    ("fingerprint", Text),
];

/// Jobs per state (with `group` columns first, each followed by a comma),
/// read from the partial index of each state group (waiting: `jobs_claim`,
/// running: `jobs_running`, finished: `jobs_finished`); the predicates
/// repeat the indexes' exactly, so both databases pick them. `filter`
/// narrows every part (`AND ...`).
fn counts_by_state(filter: &str, group: &str) -> String {
    [
        "state IN ('available', 'retrying')",
        "state = 'running'",
        "state IN ('succeeded', 'dead', 'cancelled')",
        // Worded as `jobs_group_open`'s predicate, which SQLite needs to
        // read that index.
        "group_key IS NOT NULL AND state IN ('available', 'retrying', 'running', 'blocked') \
         AND state = 'blocked'",
    ]
    .iter()
    .map(|states| {
        format!(
            "SELECT {group} state, count(*) AS n FROM jobs WHERE {states} {filter} \
             GROUP BY {group} state"
        )
    })
    .collect::<Vec<_>>()
    .join(" UNION ALL ")
}

/// The row-set key conditions of a dialect (see [`Dialect::row_keys`]).
struct Keys {
    jobs: String,
    effects: String,
    plain: String,
}

fn expand(d: &Dialect, keys: &Keys, now: &str, text: &str) -> String {
    text.replace("{job_ids}", &keys.jobs)
        .replace("{effect_keys}", &keys.effects)
        .replace("{row_keys}", &keys.plain)
        .replace("{job_cols}", JOB_COLS)
        .replace("{effect_cols}", EFFECT_COLS)
        .replace("{errors}", d.errors_col)
        .replace("{share_skip_locked}", d.share_skip_locked)
        .replace("{for_update}", d.for_update)
        .replace("{skip_locked}", d.skip_locked)
        .replace("{lock_jobs}", d.lock_jobs)
        .replace("{greatest}", d.greatest)
        .replace(
            "{job_running}",
            &(d.fence_eq)("jobs.state", "running", "id"),
        )
        .replace(
            "{effect_processing}",
            &(d.fence_eq)("effects.status", "processing", "key"),
        )
        .replace(
            "{claimer_running}",
            &(d.fence_eq)("jobs.state", "running", "job_id"),
        )
        .replace(
            "{effect_succeeded}",
            &(d.fence_eq)("effects.status", "succeeded", "key"),
        )
        .replace("{key_conflict}", KEY_CONFLICT)
        .replace("{now}", now)
}
