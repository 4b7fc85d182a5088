//! What an example prints of a store's URL: never its credentials.

/// `url` without its user and password, everything up to its last `@` after the scheme
/// (`redis://app:secret@10.0.0.1:6379/0` → `redis://10.0.0.1:6379/0`): the form for
/// messages and logs. A generated password may hold `/`, `:` or `@`, so it is cut at
/// the last `@`, not parsed.
pub fn shown(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.rsplit_once('@') {
        Some((_, place)) => format!("{scheme}://{place}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn no_credentials() {
        assert_eq!(super::shown("redis://app:Zx81/kQ9@h:1/0"), "redis://h:1/0");
        assert_eq!(super::shown("redis://h:1"), "redis://h:1");
        assert_eq!(super::shown("postgres://u:p@ss@h/db"), "postgres://h/db");
    }
}
