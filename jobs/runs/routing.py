from django.urls import path

from jobs.runs import consumers

websocket_urlpatterns = [
    path("ws/jobs/<int:job_id>/", consumers.JobConsumer.as_asgi()),
    path("ws/cluster/", consumers.ClusterConsumer.as_asgi()),
]
