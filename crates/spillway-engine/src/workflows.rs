//! J8: the workflow policies in force. Read from a directory of `*.yaml` files (or, without
//! one, the shipped policies built into the binary), each validated and versioned by the
//! hash of its text; the built-in `default` stands in for any workflow a request does not
//! name. Files are re-read every couple of seconds: a valid edit replaces its workflow
//! once the file has stopped changing, an invalid one keeps the last good version in force
//! and raises an alert. Every version the gateway ran is kept in the ledger, so the
//! console can show a diff and roll a workflow back to any of them.

use crate::clock;
use crate::error::GatewayError;
use crate::state::{AppState, Severity};
use spillway_ledger::PolicyVersion;
use spillway_policy::Workflow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// The header a request names its workflow with.
pub const HEADER: &str = "x-spillway-workflow";

/// The policies shipped in `policies/workflows/`, built in for a gateway started without a
/// workflow directory.
pub const SHIPPED: &[(&str, &str)] = &[
    (
        "customer_chat.yaml",
        include_str!("../../../policies/workflows/customer_chat.yaml"),
    ),
    (
        "support_summary.yaml",
        include_str!("../../../policies/workflows/support_summary.yaml"),
    ),
    (
        "evaluation.yaml",
        include_str!("../../../policies/workflows/evaluation.yaml"),
    ),
    (
        "image_generation.yaml",
        include_str!("../../../policies/workflows/image_generation.yaml"),
    ),
    (
        "finance_legal_review.yaml",
        include_str!("../../../policies/workflows/finance_legal_review.yaml"),
    ),
];

const POLL: Duration = Duration::from_secs(2);

/// One policy file as last read.
#[derive(Clone)]
struct FileState {
    /// The text in force (the last valid version read from this file).
    applied: Option<String>,
    /// A changed text seen once: applied when the next poll finds it unchanged.
    pending: Option<String>,
    /// The last invalid text, and why, until the file changes again.
    problem: Option<(String, String)>,
    /// The workflow the file defines (from its last valid text).
    workflow: Option<String>,
}

/// A problem with a policy file, as the console shows it.
#[derive(Clone, Debug, serde::Serialize, ts_rs::TS)]
pub struct PolicyProblem {
    pub file: String,
    pub error: String,
}

pub struct Workflows {
    dir: Option<PathBuf>,
    by_name: RwLock<BTreeMap<String, Arc<Workflow>>>,
    files: Mutex<BTreeMap<PathBuf, FileState>>,
}

fn yaml_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .is_some_and(|x| x.eq_ignore_ascii_case("yaml") || x.eq_ignore_ascii_case("yml"))
        })
        .collect();
    v.sort();
    Ok(v)
}

impl Workflows {
    /// The policies of `dir` (every `*.yaml`), or the shipped ones without it, plus the
    /// built-in `default` unless a file defines it. Any invalid file, or two files
    /// defining one workflow, stops the start: a policy is never silently left out.
    pub fn load(dir: Option<&Path>) -> Result<Workflows, String> {
        let mut by_name = BTreeMap::new();
        let mut files = BTreeMap::new();
        let mut errors = Vec::new();
        let mut add = |w: Workflow, errors: &mut Vec<String>| {
            if let Some(other) = by_name.get(&w.name).map(|o: &Arc<Workflow>| o.source.clone()) {
                errors.push(format!(
                    "{}: workflow `{}` is defined in {} already; each workflow is one file",
                    w.source, w.name, other
                ));
                return None;
            }
            let name = w.name.clone();
            by_name.insert(name.clone(), Arc::new(w));
            Some(name)
        };
        match dir {
            Some(d) => {
                let list =
                    yaml_files(d).map_err(|e| format!("cannot read the workflow directory {}: {e}", d.display()))?;
                for p in list {
                    let text = std::fs::read_to_string(&p).map_err(|e| format!("cannot read {}: {e}", p.display()))?;
                    match Workflow::parse(&p.display().to_string(), &text) {
                        Ok(w) => {
                            let name = add(w, &mut errors);
                            files.insert(
                                p,
                                FileState {
                                    applied: Some(text),
                                    pending: None,
                                    problem: None,
                                    workflow: name,
                                },
                            );
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                }
            }
            None => {
                for (file, text) in SHIPPED {
                    match Workflow::parse(&format!("built-in:{file}"), text) {
                        Ok(w) => {
                            add(w, &mut errors);
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                }
            }
        }
        if !errors.is_empty() {
            return Err(errors.join("\n"));
        }
        if !by_name.contains_key("default") {
            by_name.insert("default".into(), Arc::new(Workflow::builtin_default()));
        }
        Ok(Workflows {
            dir: dir.map(Path::to_path_buf),
            by_name: RwLock::new(by_name),
            files: Mutex::new(files),
        })
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    pub fn get(&self, name: &str) -> Option<Arc<Workflow>> {
        self.by_name
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }

    /// The workflow of a request that names none (and whose key has no default).
    pub fn default_workflow(&self) -> Arc<Workflow> {
        self.get("default")
            .unwrap_or_else(|| Arc::new(Workflow::builtin_default()))
    }

    /// A job's workflow as it runs now: its own, or `default` if its file went away.
    pub fn for_job(&self, name: &str) -> Arc<Workflow> {
        self.get(name).unwrap_or_else(|| self.default_workflow())
    }

    pub fn all(&self) -> Vec<Arc<Workflow>> {
        self.by_name
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// J8: the request's workflow: the one it names, else its key's default, else
    /// `default`. A name no policy has is refused, naming those there are.
    pub fn select(&self, named: Option<&str>, key_default: Option<&str>) -> Result<Arc<Workflow>, GatewayError> {
        if let Some(n) = named {
            return self.get(n).ok_or_else(|| GatewayError::UnknownWorkflow {
                name: n.to_owned(),
                known: self.names(),
            });
        }
        Ok(key_default
            .and_then(|k| self.get(k))
            .unwrap_or_else(|| self.default_workflow()))
    }

    fn names(&self) -> String {
        let names: Vec<String> = self
            .by_name
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .map(|n| format!("`{n}`"))
            .collect();
        names.join(", ")
    }

    /// Files whose last edit is invalid (the previous version stays in force).
    pub fn problems(&self) -> Vec<PolicyProblem> {
        self.files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|(p, f)| {
                f.problem.as_ref().map(|(_, e)| PolicyProblem {
                    file: p.display().to_string(),
                    error: e.clone(),
                })
            })
            .collect()
    }

    /// The file a workflow was read from, when it came from the directory.
    pub fn file_of(&self, workflow: &str) -> Option<PathBuf> {
        self.files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(_, f)| f.workflow.as_deref() == Some(workflow))
            .map(|(p, _)| p.clone())
    }

    /// Applies `text` as the content of `path` (valid, checked by the caller): the
    /// workflow it defines replaces its previous version. Returns (old, new).
    fn apply(&self, path: &Path, w: Workflow, text: String) -> Result<(Option<Arc<Workflow>>, Arc<Workflow>), String> {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        let mut by_name = self.by_name.write().unwrap_or_else(|p| p.into_inner());
        let previous_name = files.get(path).and_then(|f| f.workflow.clone());
        if let Some(other) = files
            .iter()
            .find(|(p, f)| p.as_path() != path && f.workflow.as_deref() == Some(w.name.as_str()))
            .map(|(p, _)| p.display().to_string())
        {
            return Err(format!(
                "{}: workflow `{}` is defined in {other} already; each workflow is one file",
                path.display(),
                w.name
            ));
        }
        if let Some(prev) = &previous_name
            && *prev != w.name
        {
            by_name.remove(prev);
        }
        let new = Arc::new(w);
        let old = by_name.insert(new.name.clone(), new.clone());
        files.insert(
            path.to_path_buf(),
            FileState {
                applied: Some(text),
                pending: None,
                problem: None,
                workflow: Some(new.name.clone()),
            },
        );
        if !by_name.contains_key("default") {
            by_name.insert("default".into(), Arc::new(Workflow::builtin_default()));
        }
        Ok((old, new))
    }

    /// One poll of the directory: what changed, to record and announce.
    fn poll(&self) -> Vec<Event> {
        let Some(dir) = &self.dir else { return Vec::new() };
        let mut events = Vec::new();
        let list = match yaml_files(dir) {
            Ok(l) => l,
            Err(_) => return events,
        };
        let known: Vec<PathBuf> = self
            .files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        // A file that went away takes its workflow with it (jobs of it run under `default`).
        for p in known.iter().filter(|p| !list.contains(p)) {
            let gone = self.files.lock().unwrap_or_else(|p| p.into_inner()).remove(p);
            if let Some(name) = gone.and_then(|f| f.workflow) {
                let mut by_name = self.by_name.write().unwrap_or_else(|p| p.into_inner());
                by_name.remove(&name);
                if name == "default" {
                    by_name.insert("default".into(), Arc::new(Workflow::builtin_default()));
                }
                events.push(Event::Removed {
                    file: p.display().to_string(),
                    workflow: name,
                });
            }
        }
        for p in list {
            let Ok(text) = std::fs::read_to_string(&p) else {
                continue;
            };
            let state = self.files.lock().unwrap_or_else(|p| p.into_inner()).get(&p).cloned();
            let state = state.unwrap_or(FileState {
                applied: None,
                pending: None,
                problem: None,
                workflow: None,
            });
            if state.applied.as_deref() == Some(text.as_str())
                || state.problem.as_ref().is_some_and(|(t, _)| *t == text)
            {
                if let Some(f) = self.files.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&p) {
                    f.pending = None;
                }
                continue;
            }
            // Applied once it has not changed for a poll: an editor's half-written save is
            // never read as a policy.
            if state.pending.as_deref() != Some(text.as_str()) {
                let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
                files.entry(p.clone()).or_insert(state).pending = Some(text);
                continue;
            }
            events.push(self.take(&p, text));
        }
        events
    }

    /// Validates and applies one file's new text.
    fn take(&self, p: &Path, text: String) -> Event {
        let file = p.display().to_string();
        let parsed = Workflow::parse(&file, &text).map_err(|e| e.to_string());
        let applied = parsed.and_then(|w| self.apply(p, w, text.clone()));
        match applied {
            Ok((old, new)) => Event::Loaded { file, old, new, text },
            Err(error) => {
                let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
                let f = files.entry(p.to_path_buf()).or_insert(FileState {
                    applied: None,
                    pending: None,
                    problem: None,
                    workflow: None,
                });
                f.pending = None;
                f.problem = Some((text, error.clone()));
                Event::Invalid { file, error }
            }
        }
    }

    /// The text each workflow in force was read from (for the ledger's version list).
    fn texts(&self) -> Vec<(Arc<Workflow>, String)> {
        let all = self.all();
        let files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        all.into_iter()
            .map(|w| {
                let text = files
                    .values()
                    .find(|f| f.workflow.as_deref() == Some(w.name.as_str()))
                    .and_then(|f| f.applied.clone())
                    .or_else(|| {
                        SHIPPED
                            .iter()
                            .find(|(f, _)| w.source == format!("built-in:{f}"))
                            .map(|(_, t)| (*t).to_owned())
                    })
                    .unwrap_or_else(|| spillway_policy::workflow::BUILTIN_DEFAULT.to_owned());
                (w, text)
            })
            .collect()
    }
}

enum Event {
    Loaded {
        file: String,
        old: Option<Arc<Workflow>>,
        new: Arc<Workflow>,
        text: String,
    },
    Invalid {
        file: String,
        error: String,
    },
    Removed {
        file: String,
        workflow: String,
    },
}

async fn record_version(st: &AppState, w: &Workflow, text: &str) {
    let v = PolicyVersion {
        workflow: w.name.clone(),
        version: w.version.clone(),
        source: w.source.clone(),
        text: text.to_owned(),
        loaded_at: clock::now(),
    };
    if let Err(e) = st.ledger.store().save_policy_version(&v).await {
        tracing::warn!(error = %e, workflow = %w.name, "could not record a workflow policy version");
    }
}

async fn announce(st: &AppState, ev: Event, actor: &str, reason: &str) {
    match ev {
        Event::Loaded { file, old, new, text } => {
            record_version(st, &new, &text).await;
            let from = old.as_ref().map(|o| o.version.clone());
            let entry = crate::money::audit(
                "policy",
                &new.name,
                actor,
                "loaded",
                reason,
                serde_json::json!([{"name": "file", "value": file}, {"name": "from_version", "value": from},
                    {"name": "to_version", "value": new.version}]),
            );
            if let Err(e) = st.ledger.store().record_transition(None, &entry).await {
                tracing::warn!(error = %e, "could not audit a workflow policy change");
            }
            st.alert(
                Severity::Resolved,
                format!("Workflow policy `{}` reloaded", new.name),
                format!(
                    "version {} from {file} (was {})",
                    new.version,
                    from.as_deref().unwrap_or("not loaded")
                ),
                Some(new.name.clone()),
            );
        }
        Event::Invalid { file, error } => st.alert(
            Severity::Warning,
            "Workflow policy not reloaded: the edit is invalid; the previous version stays in force".into(),
            format!("{file}: {error}"),
            None,
        ),
        Event::Removed { file, workflow } => st.alert(
            Severity::Warning,
            format!("Workflow policy `{workflow}` removed"),
            format!("{file} is gone; requests naming `{workflow}` are refused and its jobs run under `default`"),
            Some(workflow),
        ),
    }
}

/// Records the versions in force at start-up, then watches the directory.
pub fn upkeep(st: &Arc<AppState>) {
    let weak = Arc::downgrade(st);
    tokio::spawn(async move {
        if let Some(st) = weak.upgrade() {
            for (w, text) in st.workflows.texts() {
                record_version(&st, &w, &text).await;
            }
        }
        loop {
            tokio::time::sleep(POLL).await;
            let Some(st) = weak.upgrade() else { return };
            if st.shutdown.draining.is_cancelled() {
                return;
            }
            let events = st.workflows.poll();
            for ev in events {
                announce(&st, ev, "gateway", "the policy file changed").await;
            }
        }
    });
}

/// Why a roll back was refused.
pub enum RollbackError {
    NotFound(String),
    ReadOnly(String),
    Failed(String),
}

/// J8: puts a recorded version of `workflow` back: its text is written to the workflow's
/// file (the file stays the truth, so an editor sees what runs) and applied at once.
pub async fn rollback(
    st: &AppState,
    workflow: &str,
    version: &str,
    actor: &str,
    reason: &str,
) -> Result<Arc<Workflow>, RollbackError> {
    let versions = st
        .ledger
        .store()
        .policy_versions(Some(workflow))
        .await
        .map_err(|e| RollbackError::Failed(format!("the ledger could not list the versions: {e}")))?;
    let Some(v) = versions.into_iter().find(|v| v.version == version) else {
        return Err(RollbackError::NotFound(format!(
            "`version`: workflow `{workflow}` has no recorded version `{version}`."
        )));
    };
    let Some(path) = st.workflows.file_of(workflow) else {
        return Err(RollbackError::ReadOnly(format!(
            "Workflow `{workflow}` is not read from a policy file (built-in policies are read-only); set `workflows: DIR` in the gateway's config to edit and roll back policies."
        )));
    };
    let w = Workflow::parse(&path.display().to_string(), &v.text)
        .map_err(|e| RollbackError::Failed(format!("version {version} no longer validates: {e}")))?;
    if w.name != workflow {
        return Err(RollbackError::Failed(format!(
            "version {version} defines workflow `{}`, not `{workflow}`",
            w.name
        )));
    }
    let tmp = path.with_extension("yaml.rollback");
    std::fs::write(&tmp, &v.text)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| RollbackError::Failed(format!("cannot write {}: {e}", path.display())))?;
    let ev = st.workflows.take(&path, v.text.clone());
    let new = match &ev {
        Event::Loaded { new, .. } => new.clone(),
        Event::Invalid { error, .. } => return Err(RollbackError::Failed(error.clone())),
        Event::Removed { .. } => return Err(RollbackError::Failed("the workflow went away".into())),
    };
    announce(st, ev, actor, &format!("rolled back to {version}: {reason}")).await;
    Ok(new)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, attempts: u32) -> String {
        format!(
            "workflow: {name}\nai_api_queueing_strategy:\n  lanes:\n    background_retry: {{max_attempts: {attempts}}}\n"
        )
    }

    #[test]
    fn j8_selection_named_then_the_keys_then_default() {
        // spec: J8
        let w = Workflows::load(None).unwrap();
        assert_eq!(w.select(None, None).unwrap().name, "default");
        assert_eq!(w.select(None, Some("evaluation")).unwrap().name, "evaluation");
        assert_eq!(
            w.select(Some("customer_chat"), Some("evaluation")).unwrap().name,
            "customer_chat"
        );
        match w.select(Some("nope"), None) {
            Err(GatewayError::UnknownWorkflow { known, .. }) => assert!(known.contains("`support_summary`")),
            _ => panic!("an unknown workflow is refused"),
        }
        // Every shipped policy is built in, and the default besides.
        assert_eq!(w.all().len(), SHIPPED.len() + 1);
    }

    #[test]
    fn j8_a_directory_edit_applies_once_settled_and_a_bad_one_keeps_the_last_good() {
        // spec: J8
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), policy("a", 2)).unwrap();
        let w = Workflows::load(Some(dir.path())).unwrap();
        let v1 = w.get("a").unwrap().version.clone();
        assert_eq!(w.get("default").unwrap().source, "built-in");
        std::fs::write(dir.path().join("a.yaml"), policy("a", 4)).unwrap();
        assert!(
            w.poll().is_empty(),
            "a change is applied once it has not changed for a poll"
        );
        assert!(matches!(&w.poll()[..], [Event::Loaded { .. }]));
        assert_eq!(w.get("a").unwrap().background.max_attempts, 4);
        assert_ne!(w.get("a").unwrap().version, v1);
        std::fs::write(dir.path().join("a.yaml"), policy("a", 0)).unwrap();
        w.poll();
        assert!(matches!(&w.poll()[..], [Event::Invalid { .. }]));
        assert_eq!(
            w.get("a").unwrap().background.max_attempts,
            4,
            "the last good version stays"
        );
        assert!(w.problems()[0].error.contains("max_attempts"));
        assert!(w.poll().is_empty(), "an invalid text is reported once");
        // Two files defining one workflow cannot start.
        std::fs::write(dir.path().join("a.yaml"), policy("a", 2)).unwrap();
        std::fs::write(dir.path().join("b.yaml"), policy("a", 2)).unwrap();
        let e = Workflows::load(Some(dir.path())).err().expect("refused");
        assert!(e.contains("defined in"), "{e}");
    }
}
