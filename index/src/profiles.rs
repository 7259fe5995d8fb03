//! Model profiles as data: the JSON files under `index/profiles/`, embedded at build time.
//!
//! A profile is a [`ModelProfile`] (prefill and decode curves, KV bytes per token, tier
//! bandwidths) parsed with `serde_json`; the struct rejects unknown fields, and
//! [`from_json`] also rejects values the cost model cannot use (non-finite coefficients,
//! zero bandwidths, zero KV size), so a bad file fails when loaded rather than as NaN
//! timings deep in a simulation.
//!
//! The built-in profiles:
//!
//! - `default`: exactly [`ModelProfile::dynamo_default`], NVIDIA Dynamo's mocker curves with
//!   Llama-3.1-8B's KV size (32 layers × 8 KV heads × 128 head dim × 2 (K, V) × 2 bytes =
//!   131072 bytes per token), L1 at 25 GB/s, L2 at 12.5 GB/s.
//! - `llama-3.1-70b-h100`: Llama-3.1-70B on one 8×H100 node (tensor parallel 8). KV bytes
//!   per token: 80 layers × 8 KV heads × 128 head dim × 2 (K and V) × 2 bytes (bf16) =
//!   327680. The prefill and decode curves are Dynamo's unchanged: to first order the
//!   70B model's ~8.8× the FLOPs and weight bytes per token of the 8B model are spread over
//!   8 GPUs, so per-instance step times stay within the curves' own error (TP all-reduce
//!   overhead is not modelled). The tier bandwidths are `default`'s, one PCIe Gen5 link
//!   (L1) and a 100 Gb/s network (L2): conservative, since eight GPUs could load their
//!   shards in parallel, but host memory and the NIC are shared.
//!
//! JSON has no comments and the struct rejects unknown fields, so these derivations live
//! here rather than in the files.

use crate::cost::ModelProfile;

/// The embedded profiles: (name, JSON text). The name must equal the file's `name` field.
const BUILTIN: &[(&str, &str)] = &[
    ("default", include_str!("../profiles/default.json")),
    (
        "llama-3.1-70b-h100",
        include_str!("../profiles/llama-3.1-70b-h100.json"),
    ),
];

/// Names of the built-in profiles, in the order of [`BUILTIN`].
const NAMES: &[&str] = &["default", "llama-3.1-70b-h100"];

/// Why a profile could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// No built-in profile has this name.
    #[error("unknown profile {name:?} (known: {known})")]
    UnknownName {
        name: String,
        /// The built-in names, comma separated.
        known: String,
    },
    /// The text is not JSON of a `ModelProfile` (syntax, a missing or unknown field, a type).
    #[error("invalid profile JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The JSON parsed but a value is unusable; says which field and why.
    #[error("invalid profile {name:?}: {reason}")]
    Invalid { name: String, reason: String },
}

/// Names of the built-in profiles.
pub fn builtin_names() -> &'static [&'static str] {
    NAMES
}

/// The built-in profile called `name`.
pub fn builtin(name: &str) -> Result<ModelProfile, ProfileError> {
    match BUILTIN.iter().find(|(n, _)| *n == name) {
        Some((_, text)) => from_json(text),
        None => Err(ProfileError::UnknownName {
            name: name.to_string(),
            known: NAMES.join(", "),
        }),
    }
}

/// Parses and validates one profile.
pub fn from_json(text: &str) -> Result<ModelProfile, ProfileError> {
    let profile: ModelProfile = serde_json::from_str(text)?;
    validate(&profile)?;
    Ok(profile)
}

/// Rejects values the cost model would turn into NaN, infinite or negative times.
fn validate(p: &ModelProfile) -> Result<(), ProfileError> {
    let invalid = |reason: String| {
        Err(ProfileError::Invalid {
            name: p.name.clone(),
            reason,
        })
    };
    if p.name.is_empty() {
        return invalid("name is empty".into());
    }
    if p.kv_bytes_per_token == 0 {
        return invalid("kv_bytes_per_token must be positive".into());
    }
    let coefficients = [
        ("prefill_ms.a", p.prefill_ms.a),
        ("prefill_ms.b", p.prefill_ms.b),
        ("prefill_ms.c", p.prefill_ms.c),
        ("decode_ms.a", p.decode_ms.a),
        ("decode_ms.b", p.decode_ms.b),
        ("decode_ms.c", p.decode_ms.c),
        ("decode_ms.floor", p.decode_ms.floor),
    ];
    for (field, value) in coefficients {
        if !value.is_finite() {
            return invalid(format!("{field} must be finite, got {value}"));
        }
    }
    if p.decode_ms.floor < 0.0 {
        return invalid(format!(
            "decode_ms.floor must be non-negative, got {}",
            p.decode_ms.floor
        ));
    }
    for (field, value) in [
        ("l1_bytes_per_s", p.l1_bytes_per_s),
        ("l2_bytes_per_s", p.l2_bytes_per_s),
    ] {
        if !(value.is_finite() && value > 0.0) {
            return invalid(format!("{field} must be positive and finite, got {value}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_dynamo_default() {
        assert_eq!(builtin("default").unwrap(), ModelProfile::dynamo_default());
    }

    #[test]
    fn every_builtin_parses_under_its_own_name() {
        assert_eq!(builtin_names().len(), BUILTIN.len());
        for (&name, (file_name, _)) in builtin_names().iter().zip(BUILTIN) {
            assert_eq!(name, *file_name);
            assert_eq!(builtin(name).unwrap().name, name);
        }
    }

    #[test]
    fn llama_70b_kv_size() {
        let p = builtin("llama-3.1-70b-h100").unwrap();
        assert_eq!(p.kv_bytes_per_token, 80 * 8 * 128 * 2 * 2);
        assert_eq!(p.kv_bytes_per_token, 327_680);
        let d = ModelProfile::dynamo_default();
        assert_eq!((p.prefill_ms, p.decode_ms), (d.prefill_ms, d.decode_ms));
    }

    #[test]
    fn unknown_name_lists_known_ones() {
        let err = builtin("gpt-5").unwrap_err();
        assert!(matches!(err, ProfileError::UnknownName { .. }));
        assert_eq!(
            err.to_string(),
            r#"unknown profile "gpt-5" (known: default, llama-3.1-70b-h100)"#
        );
    }

    /// `default.json` with `from` replaced by `to`, then parsed.
    fn edited(from: &str, to: &str) -> Result<ModelProfile, ProfileError> {
        let text = BUILTIN[0].1;
        assert!(text.contains(from), "{from}");
        from_json(&text.replace(from, to))
    }

    #[test]
    fn bad_profiles_are_rejected() {
        // (edit, the error's text contains)
        let cases = [
            (("\"name\"", "\"nom\""), "unknown field `nom`"),
            (
                ("\"floor\": 1.0", "\"floor\": 1.0, \"d\": 2"),
                "unknown field `d`",
            ),
            (
                ("\"l2_bytes_per_s\": 12.5e9", "\"l2_bytes_per_s\": 0"),
                "l2_bytes_per_s must be positive",
            ),
            (
                ("\"l1_bytes_per_s\": 25e9", "\"l1_bytes_per_s\": -1"),
                "l1_bytes_per_s must be positive",
            ),
            (("131072", "0"), "kv_bytes_per_token must be positive"),
            (("131072", "-1"), "invalid profile JSON"),
            (("\"default\"", "\"\""), "name is empty"),
            (
                ("\"floor\": 1.0", "\"floor\": -1.0"),
                "decode_ms.floor must be non-negative",
            ),
            (("\"c\": 5.74", "\"c\": 1e999"), "invalid profile JSON"),
            (("{", "["), "invalid profile JSON"),
        ];
        for ((from, to), want) in cases {
            let err = edited(from, to).unwrap_err().to_string();
            assert!(err.contains(want), "{from} -> {to}: {err}");
        }
        assert!(from_json("").is_err());
    }
}
