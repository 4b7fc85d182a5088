//! [`Namespace`]: the fixed, trusted part in front of lock keys, validated by one rule.

use std::borrow::Cow;
use std::fmt;

use crate::error::ConfigError;

type Result<T, E = ConfigError> = std::result::Result<T, E>;
use crate::key::MAX_KEY_LEN;

/// The longest namespace or key prefix, in bytes: half of [`MAX_KEY_LEN`], so that a
/// namespaced key keeps the other half for the part a request supplies.
pub const MAX_NAMESPACE_LEN: usize = MAX_KEY_LEN / 2;

/// A fixed, trusted text in front of lock keys: at most [`MAX_NAMESPACE_LEN`] bytes,
/// without braces or control characters; empty for none. Cheap to clone for a
/// `'static` text.
///
/// Four settings put a fixed text in front of keys, and all follow this one rule: a
/// namespace given to [`LockKey::namespaced`](crate::LockKey::namespaced), an
/// extractor's `namespace` ([`HeaderKey`](crate::layer::HeaderKey) and the others), the
/// layer's [`key_prefix`](crate::layer::LockLayerBuilder::key_prefix) and the Redis
/// backend's `key_prefix`.
///
/// **One rule:** a namespace is one or more name segments joined by single `:`s
/// (`lock`, `lock:order`), and every setting joins it to what follows with one `:`
/// (`lock:order` + `{42}` → `lock:order:{42}`; the Redis backend's `myapp` + `NAME` →
/// `myapp:NAME`). So a `:` at either end, or two in a row, is refused rather than
/// doubled: `"lock:"` would give `lock::{42}`. Braces would move a lock's companion keys
/// to another Redis Cluster slot than the lock, or let the fixed part open a hash tag of
/// its own; control characters have no place in a key. Each setting's error names the
/// setting. The layer's `key_prefix` must also not be empty (leave it unset for none).
///
/// # Example
///
/// ```
/// use tower_lock::{ConfigError, Namespace};
///
/// let ns = Namespace::new("lock:order")?;
/// assert_eq!(ns.as_str(), "lock:order");
/// assert!(Namespace::new("").is_ok(), "none");
/// assert!(matches!(
///     Namespace::new("a{b"),
///     Err(ConfigError::InvalidSetting { name: "namespace", .. })
/// ));
/// // The joining `:` is the crate's: a namespace neither ends nor starts with one.
/// let err = Namespace::new("lock:").unwrap_err();
/// assert!(err.to_string().contains("write \"lock\""), "{err}");
/// # Ok::<(), tower_lock::Error>(())
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Namespace(Cow<'static, str>);

impl Namespace {
    /// Checks `namespace` against the rule.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`](crate::ConfigError::InvalidSetting) naming `namespace` when it is longer than
    /// [`MAX_NAMESPACE_LEN`] bytes, contains braces or control characters, or starts or
    /// ends with `:` or has two in a row.
    pub fn new(namespace: impl Into<Cow<'static, str>>) -> Result<Self> {
        Self::for_setting("namespace", namespace)
    }

    /// [`Namespace::new`] for the setting `setting`, which the error names.
    pub(crate) fn for_setting(
        setting: &'static str,
        namespace: impl Into<Cow<'static, str>>,
    ) -> Result<Self> {
        let namespace = namespace.into();
        match check(&namespace) {
            Ok(()) => Ok(Namespace(namespace)),
            Err(reason) => Err(ConfigError::invalid_setting(setting, reason)),
        }
    }

    /// No namespace.
    pub const fn empty() -> Self {
        Namespace(Cow::Borrowed(""))
    }

    /// The namespace as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is no namespace at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The rule: what is wrong with `namespace`, if anything.
pub(crate) fn check(namespace: &str) -> std::result::Result<(), String> {
    if namespace.len() > MAX_NAMESPACE_LEN
        || namespace.contains(['{', '}'])
        || namespace.chars().any(char::is_control)
    {
        return Err(format!(
            "must be at most {MAX_NAMESPACE_LEN} bytes without braces or control characters (got {} bytes: {:?})",
            namespace.len(),
            Shortened(namespace),
        ));
    }
    crate::key::check_not_reserved(&[namespace, ":"].concat())?;
    if !namespace.is_empty()
        && (namespace.starts_with(':') || namespace.ends_with(':') || namespace.contains("::"))
    {
        let trimmed: Vec<&str> = namespace.split(':').filter(|s| !s.is_empty()).collect();
        return Err(format!(
            "must be name segments joined by single `:`s, without one at either end: the `:` \
             that joins it to the key is added (got {:?}; write {:?})",
            Shortened(namespace),
            trimmed.join(":"),
        ));
    }
    Ok(())
}

/// A long text in an error message: its first 64 characters.
struct Shortened<'a>(&'a str);

impl fmt::Debug for Shortened<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.char_indices().nth(64) {
            Some((end, _)) => write!(f, "{:?}…", &self.0[..end]),
            None => fmt::Debug::fmt(self.0, f),
        }
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Namespace {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rule_and_the_error_names_the_setting() {
        for ok in [
            "",
            "lock:order",
            "app",
            "a:b:c",
            &"n".repeat(MAX_NAMESPACE_LEN),
        ] {
            assert!(Namespace::new(ok.to_owned()).is_ok(), "{ok:?}");
        }
        let long = "n".repeat(MAX_NAMESPACE_LEN + 1);
        for bad in ["a{b", "x}", "tab\t", "nl\n", "\u{85}", long.as_str()] {
            match Namespace::for_setting("key_prefix", bad.to_owned()) {
                Err(ConfigError::InvalidSetting {
                    name: "key_prefix",
                    reason,
                }) => assert!(reason.starts_with("must be at most 512 bytes"), "{reason}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        for (bad, fix) in [("app:", "app"), (":app", "app"), ("a::b", "a:b"), (":", "")] {
            match Namespace::for_setting("key_prefix", bad.to_owned()) {
                Err(ConfigError::InvalidSetting {
                    name: "key_prefix",
                    reason,
                }) => assert!(
                    reason.starts_with("must be name segments joined by single `:`s")
                        && reason.ends_with(&format!("write {fix:?})")),
                    "{reason}"
                ),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let err = Namespace::new(long).unwrap_err().to_string();
        assert!(
            err.contains("(got 513 bytes: \"nnnn") && err.ends_with("…)"),
            "{err}"
        );
    }
}
