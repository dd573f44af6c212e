//! Test databases for the ledger's own tests, so each runs on both stores (R1: the ledger
//! also runs on PostgreSQL, with the same migrations and the same tests).
//!
//! SQLite needs nothing: a file in a temporary directory. PostgreSQL needs a server the
//! tests may create databases on, named by `SPILLWAY_TEST_POSTGRES` (a URL to a database
//! to connect to for `CREATE DATABASE`, e.g. `postgres://spillway@127.0.0.1:5433/postgres`).
//! Each test gets a fresh, empty database of its own there; they are not dropped (a `Drop`
//! cannot wait for the server), as the server `make test` starts is thrown away after it.
//! Without the variable the PostgreSQL half of each test is skipped, saying so, unless
//! `SPILLWAY_REQUIRE_SERVICES=1` (`make test` sets it): then its absence is a failure.

use crate::{Ledger, LedgerBackend, PgBackend, RequestRecord, RequestState, SqliteBackend};
use spillway_wire::{Format, UnixMs};
use sqlx::Connection;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The variable naming the PostgreSQL server the tests may create databases on.
const POSTGRES_VAR: &str = "SPILLWAY_TEST_POSTGRES";
/// Set to `1` (as `make test` does), a missing server fails the tests instead of skipping.
const REQUIRE_VAR: &str = "SPILLWAY_REQUIRE_SERVICES";

/// Which store a [`TestDb`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Sqlite,
    Postgres,
}

/// One test's database.
pub(crate) struct TestDb {
    pub kind: Kind,
    /// SQLite: holds the ledger file (`l.db`). Kept for PostgreSQL too (a scratch directory).
    dir: tempfile::TempDir,
    /// PostgreSQL: the URL of this test's own database.
    url: Option<String>,
    /// The instance name the stores and ledgers of this database are opened as (one per
    /// database, so a reopen is the same instance restarting, as SQLite's is).
    pub instance: String,
}

impl TestDb {
    /// A ledger file in a fresh temporary directory.
    pub async fn sqlite() -> TestDb {
        TestDb {
            kind: Kind::Sqlite,
            dir: tempfile::tempdir().expect("a temporary directory for the test ledger"),
            url: None,
            instance: "spw-test".into(),
        }
    }

    /// A fresh, empty database on the PostgreSQL server named by `SPILLWAY_TEST_POSTGRES`;
    /// None (having said the PostgreSQL half was skipped, and how to run it) when the
    /// variable is unset, unless `SPILLWAY_REQUIRE_SERVICES=1`: then it panics.
    pub async fn postgres() -> Option<TestDb> {
        let admin = match std::env::var(POSTGRES_VAR) {
            Ok(url) if !url.trim().is_empty() => url.trim().to_owned(),
            _ => {
                if std::env::var(REQUIRE_VAR).is_ok_and(|v| v.trim() == "1") {
                    panic!(
                        "{REQUIRE_VAR}=1 but {POSTGRES_VAR} is not set: the ledger's tests must also run on \
                         PostgreSQL (R1). Set {POSTGRES_VAR} to a URL of a database the tests may CREATE \
                         DATABASE from, e.g. postgres://spillway@127.0.0.1:5433/postgres"
                    );
                }
                let test = std::thread::current().name().unwrap_or("this test").to_owned();
                eprintln!(
                    "skipped the PostgreSQL half of {test}: {POSTGRES_VAR} is not set. To run it, point it at a \
                     server the tests may create databases on, e.g. \
                     {POSTGRES_VAR}=postgres://spillway@127.0.0.1:5433/postgres cargo test -p spillway-ledger"
                );
                return None;
            }
        };
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let name = format!("spw_t_{}_{n}_{nanos}", std::process::id());
        let shown = without_credentials(&admin);
        let mut conn = sqlx::PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {POSTGRES_VAR} ({shown}): {e}"));
        // PostgreSQL refuses to copy its template while another session is connected to
        // it (an autovacuum worker can be, for a moment): try again, a few times.
        let mut tries = 0;
        loop {
            match sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
                .execute(&mut conn)
                .await
            {
                Ok(_) => break,
                // 55006: object_in_use ("source database is being accessed by other users").
                Err(e) if tries < 10 && e.as_database_error().and_then(|d| d.code()).as_deref() == Some("55006") => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                Err(e) => panic!("cannot create the test database {name} on {shown}: {e}"),
            }
        }
        let _ = conn.close().await;
        Some(TestDb {
            kind: Kind::Postgres,
            dir: tempfile::tempdir().expect("a temporary directory for the test"),
            url: Some(with_database(&admin, &name)),
            instance: "spw-test".into(),
        })
    }

    /// The SQLite ledger file (for a test that needs the file itself).
    pub fn path(&self) -> PathBuf {
        self.dir.path().join("l.db")
    }

    fn pg_url(&self) -> &str {
        self.url.as_deref().expect("a PostgreSQL test database has its URL")
    }

    /// Opens the store (again): the same data each time. SQLite's lock file lets one store
    /// hold the ledger at a time, so drop (or close) the last one first there.
    pub async fn backend(&self) -> Arc<dyn LedgerBackend> {
        match self.kind {
            Kind::Sqlite => Arc::new(
                SqliteBackend::open(&self.path())
                    .await
                    .expect("the SQLite test ledger opens"),
            ),
            Kind::Postgres => Arc::new(
                PgBackend::open(self.pg_url(), &self.instance)
                    .await
                    .expect("the PostgreSQL test ledger opens"),
            ),
        }
    }

    /// Opens the ledger (again) as this database's instance, as the gateway does at
    /// start-up: a reopen is that instance restarting.
    pub async fn ledger(&self) -> Ledger {
        self.ledger_as(&self.instance).await
    }

    /// Opens the ledger as instance `instance` (R1: several instances share a PostgreSQL
    /// ledger). SQLite has one instance and records none: there this is [`TestDb::ledger`].
    pub async fn ledger_as(&self, instance: &str) -> Ledger {
        match self.kind {
            Kind::Sqlite => Ledger::open_sqlite(&self.path())
                .await
                .expect("the SQLite test ledger opens"),
            Kind::Postgres => Ledger::open_postgres(self.pg_url(), instance, 10_000)
                .await
                .expect("the PostgreSQL test ledger opens"),
        }
    }
}

/// `url` with its database (the path) replaced by `name`, keeping any `?query`.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url.split_at(url.find('?').unwrap_or(url.len()));
    // The path starts at the first `/` after `scheme://`; an URL without one gets one.
    let authority = base.find("://").map_or(0, |i| i + 3);
    let server = match base[authority..].find('/') {
        Some(i) => &base[..authority + i],
        None => base,
    };
    format!("{server}/{name}{query}")
}

/// `url` without a password, for messages.
fn without_credentials(url: &str) -> String {
    let authority = url.find("://").map_or(0, |i| i + 3);
    let end = url[authority..].find(['/', '?']).map_or(url.len(), |i| authority + i);
    let Some(at) = url[authority..end].rfind('@') else {
        return url.to_owned();
    };
    match url[authority..authority + at].split_once(':') {
        Some((user, _)) => format!("{}{user}:***{}", &url[..authority], &url[authority + at..]),
        None => url.to_owned(),
    }
}

/// Turns each
///
/// ```ignore
/// both_backends! {
///     async fn i3_durable_calling_api_then_done(db) { /* a test using `db: TestDb` */ }
///     #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
///     async fn another(db) { /* ... */ }
/// }
/// ```
///
/// into a module of that name holding two tests, `sqlite` and `postgres`, each running
/// the body with `db` its kind of [`TestDb`] (`#[tokio::test]` unless another
/// `#[tokio::test(...)]` is given). The PostgreSQL one returns at once when no server is
/// configured (see [`TestDb::postgres`]). The body sees the enclosing module's items.
macro_rules! both_backends {
    () => {};
    (@one [$($args:tt)?] $name:ident $db:ident $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[tokio::test $($args)?]
            async fn sqlite() {
                let $db = $crate::testdb::TestDb::sqlite().await;
                $body
            }

            #[tokio::test $($args)?]
            async fn postgres() {
                let Some($db) = $crate::testdb::TestDb::postgres().await else {
                    return;
                };
                $body
            }
        }
    };
    (
        #[tokio::test $args:tt]
        async fn $name:ident($db:ident) $body:block
        $($rest:tt)*
    ) => {
        $crate::testdb::both_backends!(@one [$args] $name $db $body);
        $crate::testdb::both_backends! { $($rest)* }
    };
    (
        async fn $name:ident($db:ident) $body:block
        $($rest:tt)*
    ) => {
        $crate::testdb::both_backends!(@one [] $name $db $body);
        $crate::testdb::both_backends! { $($rest)* }
    };
}
pub(crate) use both_backends;

/// A request record as the tests write it: an OpenAI chat request by key `app`, admitted.
pub(crate) fn rec(id: &str, state: RequestState) -> RequestRecord {
    let mut r = RequestRecord::received(
        id.into(),
        "0af7651916cd43dd8448eb211c80319c".into(),
        Format::OpenAi,
        "/v1/chat/completions",
        UnixMs(1),
    );
    r.client_request_id = Some("client-1".into());
    r.key_name = Some("app".into());
    r.owner = Some("team-a".into());
    r.route = Some("openai/gpt-4o-mini".into());
    r.channel = Some("openai-a".into());
    r.requested_model = Some("gpt-4o-mini".into());
    r.served_model = Some("gpt-4o-mini".into());
    r.state = state;
    r.admitted_at = Some(UnixMs(2));
    r.body_sha256 = Some("ab".into());
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_database_replaces_the_servers_database_and_keeps_the_query() {
        assert_eq!(
            with_database("postgres://spillway@127.0.0.1:5433/postgres", "spw_t_1"),
            "postgres://spillway@127.0.0.1:5433/spw_t_1"
        );
        assert_eq!(
            with_database("postgres://u:p@db:5432/postgres?sslmode=disable", "x"),
            "postgres://u:p@db:5432/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://db:5432", "x"), "postgres://db:5432/x");
        assert_eq!(
            with_database("postgresql:///postgres?host=/run/postgresql", "x"),
            "postgresql:///x?host=/run/postgresql"
        );
        assert_eq!(
            without_credentials("postgres://u:secret@db:5432/postgres"),
            "postgres://u:***@db:5432/postgres"
        );
        assert_eq!(
            without_credentials("postgres://u@db/postgres"),
            "postgres://u@db/postgres"
        );
    }
}
