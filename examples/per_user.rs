//! The smallest per-user serialization: each user's requests run one at a time,
//! different users' in parallel.
//!
//! ```sh
//! cargo run --example per_user
//! # in another shell: the second request waits for the first (about 1 s each)
//! curl -H 'x-user-id: 7' localhost:3001/slow & curl -H 'x-user-id: 7' localhost:3001/slow
//! ```

use std::time::Duration;

use axum::{Router, routing::get};
use http::HeaderName;
use tower_lock::extract::HeldLock;
use tower_lock::layer::{HeaderKey, LockLayer};
use tower_lock::{LockClient, MemoryBackend};

async fn slow(held: HeldLock) -> String {
    tokio::time::sleep(Duration::from_secs(1)).await;
    format!("done under {} (owner {})\n", held.key(), held.owner())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let by_user = HeaderKey::new(HeaderName::from_static("x-user-id")).namespace("user")?;
    // On the handler: only `GET /slow` is locked (and needs the header); an unknown path
    // or a wrong method is still axum's 404 or 405, not the layer's 400.
    // One client per store, made at startup; every layer gets a clone of it.
    let client = LockClient::new(MemoryBackend::new());
    let layer = LockLayer::new(client.clone(), by_user);
    let app = Router::new().route("/slow", get(slow).route_layer(layer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3001").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
