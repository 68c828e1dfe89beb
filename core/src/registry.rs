//! Which backends exist, and which one runs a given model.
//!
//! Built-in backends announce themselves with `inventory::submit!` of a
//! [`BuiltinBackend`]; plugins loaded at run time are added with [`Registry::register`].
//! Selection asks every backend: unavailable devices and refusals are kept with their
//! reasons so a user can see why a backend was or was not chosen.

use std::sync::Arc;

use crate::backend::{Backend, Support};
use crate::error::{Error, Result};
use crate::ir::ModelIr;

/// A backend compiled into the binary. Submit one with
/// `inventory::submit! { BuiltinBackend { create: || Arc::new(MyBackend) } }`.
pub struct BuiltinBackend {
    pub create: fn() -> Arc<dyn Backend>,
}
inventory::collect!(BuiltinBackend);

/// One backend's verdict on one model.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub name: String,
    /// `Ok(device)` or `Err(why the device is unusable)`.
    pub probe: Result<String, String>,
    /// Only asked when the probe succeeded.
    pub support: Support,
}

impl Candidate {
    /// Score if the backend is usable for the model.
    pub fn score(&self) -> Option<u32> {
        self.probe.as_ref().ok().and(self.support.score())
    }
    /// Why it cannot run the model, if it cannot.
    pub fn refusal(&self) -> Option<String> {
        match (&self.probe, &self.support) {
            (Err(why), _) => Some(format!("unavailable: {why}")),
            (Ok(_), Support::No { reason }) => Some(reason.clone()),
            _ => None,
        }
    }
}

#[derive(Clone, Default)]
pub struct Registry {
    backends: Vec<Arc<dyn Backend>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Every backend submitted through `inventory` in this binary, sorted by name.
    pub fn with_builtins() -> Self {
        let mut backends: Vec<Arc<dyn Backend>> = inventory::iter::<BuiltinBackend>()
            .map(|b| (b.create)())
            .collect();
        backends.sort_by(|a, b| a.name().cmp(b.name()));
        Registry { backends }
    }

    /// Adds a backend; fails if one with the same name is already there.
    pub fn register(&mut self, backend: Arc<dyn Backend>) -> Result<()> {
        if self.get(backend.name()).is_some() {
            return Err(Error::InvalidArgument(format!(
                "a backend named '{}' is already registered",
                backend.name()
            )));
        }
        self.backends.push(backend);
        Ok(())
    }

    pub fn backends(&self) -> &[Arc<dyn Backend>] {
        &self.backends
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn Backend>> {
        self.backends.iter().find(|b| b.name() == name).cloned()
    }

    /// Every backend's verdict on `model`, best first (usable ones by score, then the rest).
    pub fn rank(&self, model: &ModelIr) -> Vec<Candidate> {
        let mut out: Vec<Candidate> = self
            .backends
            .iter()
            .map(|b| {
                let probe = b.probe();
                let support = match &probe {
                    Ok(_) => b.supports(model),
                    Err(_) => Support::No {
                        reason: "device unavailable".into(),
                    },
                };
                Candidate {
                    name: b.name().to_string(),
                    probe,
                    support,
                }
            })
            .collect();
        // A stable sort: equal scores keep registration order (built-ins before plugins).
        out.sort_by_key(|c| std::cmp::Reverse(c.score()));
        out
    }

    /// Picks the backend to run `model`: the one named by `preferred`, or the best scorer.
    /// The error explains every refusal.
    pub fn select(
        &self,
        model: &ModelIr,
        preferred: Option<&str>,
    ) -> Result<(Arc<dyn Backend>, Vec<Candidate>)> {
        let ranked = self.rank(model);
        let explain = |c: &[Candidate]| {
            c.iter()
                .map(|c| {
                    format!(
                        "  {}: {}",
                        c.name,
                        c.refusal().unwrap_or_else(|| "ok".into())
                    )
                })
                .collect::<Vec<_>>()
                .join("\n")
        };
        let chosen = match preferred {
            Some(name) => {
                let Some(c) = ranked.iter().find(|c| c.name == name) else {
                    let names: Vec<&str> = self.backends.iter().map(|b| b.name()).collect();
                    return Err(Error::NoBackend(format!(
                        "no backend named '{name}'; known: {}",
                        names.join(", ")
                    )));
                };
                if let Some(why) = c.refusal() {
                    return Err(Error::NoBackend(format!(
                        "backend '{name}' cannot run {}: {why}",
                        model.source
                    )));
                }
                c
            }
            None => ranked.iter().find(|c| c.score().is_some()).ok_or_else(|| {
                Error::NoBackend(format!(
                    "no backend can run {}:\n{}",
                    model.source,
                    explain(&ranked)
                ))
            })?,
        };
        let backend = self
            .get(&chosen.name)
            .expect("ranked backends come from the registry");
        Ok((backend, ranked))
    }
}
