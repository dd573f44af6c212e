//! The console's TypeScript types are generated from the Rust ones (ts-rs) and committed
//! under `ui/src/bindings/`. This test regenerates them and fails when the committed copy
//! is stale; `UPDATE_BINDINGS=1 cargo test -p spillway-engine --test bindings` rewrites it.

use spillway_engine::admin::{
    AdminError, BreakerAction, BulkReconcile, BulkReconciled, OperatorAction, Overview, PruneAction, RequestDetail,
    Tick,
};
use spillway_engine::state::OperatorAlert;
use spillway_ledger::{AuditEntry, Page, PruneReport, Reconcile, Search};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use ts_rs::{Config, TS};

fn files(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "ts") {
            out.insert(
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read_to_string(&p).unwrap(),
            );
        }
    }
    out
}

#[test]
fn ui_bindings_are_current() {
    let tmp = tempfile::tempdir().unwrap();
    // serde_json writes u64/i64 as JSON numbers, so the UI sees `number`, not `bigint`.
    let cfg = Config::new().with_out_dir(tmp.path()).with_large_int("number");
    Overview::export_all(&cfg).unwrap();
    Tick::export_all(&cfg).unwrap();
    RequestDetail::export_all(&cfg).unwrap();
    AdminError::export_all(&cfg).unwrap();
    OperatorAlert::export_all(&cfg).unwrap();
    Page::export_all(&cfg).unwrap();
    Search::export_all(&cfg).unwrap();
    AuditEntry::export_all(&cfg).unwrap();
    BreakerAction::export_all(&cfg).unwrap();
    OperatorAction::export_all(&cfg).unwrap();
    Reconcile::export_all(&cfg).unwrap();
    PruneAction::export_all(&cfg).unwrap();
    PruneReport::export_all(&cfg).unwrap();
    BulkReconcile::export_all(&cfg).unwrap();
    BulkReconciled::export_all(&cfg).unwrap();
    spillway_engine::money::CostView::export_all(&cfg).unwrap();
    spillway_engine::money::MadeKey::export_all(&cfg).unwrap();
    spillway_engine::money::NewKey::export_all(&cfg).unwrap();
    spillway_engine::money::SpendLimitAction::export_all(&cfg).unwrap();
    spillway_engine::money::TopUp::export_all(&cfg).unwrap();
    spillway_engine::jobs::JobView::export_all(&cfg).unwrap();
    spillway_engine::inbox::JobDetail::export_all(&cfg).unwrap();
    spillway_engine::inbox::DeadLetterDetail::export_all(&cfg).unwrap();
    spillway_engine::inbox::BulkPreview::export_all(&cfg).unwrap();
    spillway_engine::inbox::FormError::export_all(&cfg).unwrap();
    spillway_engine::inbox::JobFilter::export_all(&cfg).unwrap();
    spillway_engine::inbox::PoliciesView::export_all(&cfg).unwrap();
    spillway_engine::recovery::RecoveryList::export_all(&cfg).unwrap();
    spillway_engine::recovery::RecoveryView::export_all(&cfg).unwrap();
    spillway_engine::scorecard::Scorecard::export_all(&cfg).unwrap();
    // R1, R2: InstanceView inlines its flattened row; InstanceRow is exported on its own.
    spillway_engine::fleet::FleetView::export_all(&cfg).unwrap();
    spillway_ledger::InstanceRow::export_all(&cfg).unwrap();
    let fresh = files(tmp.path());
    let committed_dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ui/src/bindings");
    if std::env::var_os("UPDATE_BINDINGS").is_some() {
        let _ = std::fs::remove_dir_all(&committed_dir);
        std::fs::create_dir_all(&committed_dir).unwrap();
        for (name, text) in &fresh {
            std::fs::write(committed_dir.join(name), text).unwrap();
        }
    }
    let committed = files(&committed_dir);
    assert_eq!(
        committed.keys().collect::<Vec<_>>(),
        fresh.keys().collect::<Vec<_>>(),
        "ui/src/bindings is stale: run UPDATE_BINDINGS=1 cargo test -p spillway-engine --test bindings"
    );
    for (name, text) in &fresh {
        assert_eq!(
            &committed[name], text,
            "ui/src/bindings/{name} is stale: run UPDATE_BINDINGS=1 cargo test -p spillway-engine --test bindings"
        );
    }
}
